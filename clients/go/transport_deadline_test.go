// The Transport and time: the policy's and the context's deadlines bound the retries, a
// canceled context interrupts a backoff sleep at once, a retry that never went out (canceled
// during its sleep, or its body not rebuilt) is not counted and gives its budget token back,
// and every attempt declares, in X-Stainless-Read-Timeout, how long the caller will still wait
// for it: from the context's deadline or, without one, the base transport's timeout.

package kvgate

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestPolicyDeadlineRespected(t *testing.T) {
	clock := newFakeClock()
	start := clock.Now()
	srv := newScripted(t, make429s(100), http.Header{"Retry-After-Ms": {"2000"}})
	p := DefaultPolicy()
	p.MaxAttempts, p.Deadline = 100, 9*time.Second
	tr := newTestTransport(t, clock, &p, nil)
	resp := post(t, tr, srv.server.URL, "{}")
	resp.Body.Close()
	if resp.StatusCode != 429 || clock.Now().Sub(start) > 9*time.Second || len(srv.attempts()) < 2 {
		t.Fatal(resp.StatusCode, clock.Now().Sub(start), len(srv.attempts()))
	}
	if o := tr.Stats().Outcomes; o[OutcomeDeadline] != 1 || len(o) != 1 {
		t.Fatal(o)
	}
}

func TestContextDeadlineRespected(t *testing.T) {
	clock := newFakeClock()
	start := clock.Now()
	srv := newScripted(t, make429s(100), http.Header{"Retry-After-Ms": {"2000"}})
	p := DefaultPolicy()
	p.MaxAttempts = 100
	tr := newTestTransport(t, clock, &p, nil)
	// The context's deadline (5 s on the injected clock, an hour of real time away in effect:
	// the fake clock does not move the real one) is sooner than the policy's 60 s.
	ctx, cancel := context.WithDeadline(context.Background(), start.Add(5*time.Second))
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || clock.Now().Sub(start) > 5*time.Second || len(srv.attempts()) < 2 {
		t.Fatal(resp.StatusCode, clock.Now().Sub(start), len(srv.attempts()))
	}
	if o := tr.Stats().Outcomes; o[OutcomeDeadline] != 1 {
		t.Fatal(o)
	}
}

// sleepSignal is the real clock, telling when a backoff sleep has begun.
type sleepSignal struct {
	Clock
	sleeping chan struct{}
}

func (c sleepSignal) Sleep(ctx context.Context, d time.Duration) error {
	close(c.sleeping)
	return c.Clock.Sleep(ctx, d)
}

// A canceled context interrupts a real backoff sleep at once.
func TestContextCancellationInterruptsTheSleep(t *testing.T) {
	srv := newScripted(t, make429s(10), http.Header{"Retry-After": {"30"}})
	// The real clock: the sleep would last 30 s or more. The context is canceled once the
	// sleep has begun (canceled while the 429 is still being read, it is an attempt's error).
	clock := sleepSignal{SystemClock(), make(chan struct{})}
	retrier, err := NewRetrier(RetrierOptions{Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	tr := NewTransport(nil, retrier)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-clock.sleeping
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	started := time.Now()
	resp, err := tr.RoundTrip(req)
	if !errors.Is(err, context.Canceled) || resp != nil {
		t.Fatal(resp, err)
	}
	if took := time.Since(started); took > 10*time.Second {
		t.Fatalf("returned after %v", took)
	}
	if o := tr.Stats().Outcomes; o[OutcomeCanceled] != 1 || len(srv.attempts()) != 1 {
		t.Fatal(o, len(srv.attempts()))
	}
}

// A retry whose backoff sleep is cut short was never sent: it is neither an attempt nor a
// retry in the counters, during the sleep or after, and its token goes back to the budget.
func TestARetryCanceledDuringItsSleepIsNotCounted(t *testing.T) {
	clock := newFakeClock()
	srv := newScripted(t, make429s(10), nil)
	tr := newTestTransport(t, clock, nil, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var during Stats
	clock.onSleep = func(time.Duration) {
		during = tr.Stats()
		cancel()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	if resp, err := tr.RoundTrip(req); !errors.Is(err, context.Canceled) || resp != nil {
		t.Fatal(resp, err)
	}
	checkOnlyTheFirstAttemptCounted(t, srv, OutcomeCanceled, during, tr.Stats())
}

// The same for a retry whose body cannot be built again.
func TestARetryWhoseBodyCannotBeRebuiltIsNotCounted(t *testing.T) {
	srv := newScripted(t, make429s(10), nil)
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	req, _ := http.NewRequest(http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	gone := errors.New("body gone")
	req.GetBody = func() (io.ReadCloser, error) { return nil, gone }
	if resp, err := tr.RoundTrip(req); !errors.Is(err, gone) || resp != nil {
		t.Fatal(resp, err)
	}
	checkOnlyTheFirstAttemptCounted(t, srv, OutcomeError, tr.Stats())
}

// checkOnlyTheFirstAttemptCounted checks the snapshots, the last one taken after the request
// ended (the token of a decided retry is held until then).
func checkOnlyTheFirstAttemptCounted(t *testing.T, srv *scripted, outcome string, snapshots ...Stats) {
	t.Helper()
	if n := len(srv.attempts()); n != 1 {
		t.Fatalf("%d attempts reached the server", n)
	}
	for _, st := range snapshots {
		if st.Requests != 1 || st.Attempts != 1 || st.Retries != 0 {
			t.Fatalf("%+v", st)
		}
	}
	last := snapshots[len(snapshots)-1]
	if last.Budget.Retries != 0 || last.Budget.Tokens != MaxTokens {
		t.Fatalf("%+v", last.Budget)
	}
	if o := last.Outcomes; o[outcome] != 1 || len(o) != 1 {
		t.Fatal(o)
	}
}

func make429s(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = 429
	}
	return s
}

// Every attempt declares the time its context has left, less the margin for the answer's way
// back, computed again after each backoff sleep.
func TestEveryAttemptDeclaresTheTimeLeft(t *testing.T) {
	srv := newScripted(t, []int{429, 503}, nil)
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	deadline := clock.Now().Add(10 * time.Second)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	attempts, slept := srv.attempts(), clock.slept()
	if len(attempts) != 3 || len(slept) != 2 {
		t.Fatal(len(attempts), slept)
	}
	left := 10 * time.Second
	for i, a := range attempts {
		if i > 0 {
			left -= slept[i-1]
		}
		if want := readTimeout(left); a.readTimeout != want || a.requestTimeout != "" {
			t.Fatalf("attempt %d declared %q (%q), want %q", i, a.readTimeout, a.requestTimeout, want)
		}
	}
	// The client's raw wait: the gateway takes its own margin off it.
	if attempts[0].readTimeout != "10.000" || req.Header.Get(HeaderReadTimeout) != "" {
		t.Fatal(attempts[0].readTimeout, req.Header)
	}
}

// observing wraps a base transport, hiding its settings from Transport.
type observing struct{ base http.RoundTripper }

func (o observing) RoundTrip(req *http.Request) (*http.Response, error) { return o.base.RoundTrip(req) }

// Without a context deadline, the base's response-header timeout bounds the wait (600 s for
// DefaultBase); with neither, nothing is declared, nor below a wrapper, which hides the
// base's timeout (the context's deadline alone then counts). A value the caller set is sent
// as it is, and a caller's X-Request-Timeout (the wait for the queue alone) does not stop the
// client's own wait from being declared.
func TestTheDeclaredWaitWithoutADeadline(t *testing.T) {
	srv := newScripted(t, nil, nil)
	send := func(tr http.RoundTripper, ctx context.Context, h http.Header) seen {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.server.URL, strings.NewReader("{}"))
		for k, v := range h {
			req.Header[k] = v
		}
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		a := srv.attempts()
		return a[len(a)-1]
	}
	clock := newFakeClock()
	retrier := mustRetrier(t, RetrierOptions{Clock: clock})
	bg := context.Background()
	if got := send(NewTransport(nil, retrier), bg, nil); got.readTimeout != "600.000" || got.requestTimeout != "" {
		t.Fatal(got)
	}
	if got := send(NewTransport(&http.Transport{}, retrier), bg, nil); got.readTimeout != "" {
		t.Fatal(got)
	}
	wrapped := NewTransport(observing{DefaultBase()}, retrier)
	if got := send(wrapped, bg, nil); got.readTimeout != "" {
		t.Fatal(got)
	}
	ctx, cancel := context.WithDeadline(bg, clock.Now().Add(2500*time.Millisecond))
	defer cancel()
	if got := send(wrapped, ctx, nil); got.readTimeout != "2.500" {
		t.Fatal(got)
	}
	for _, name := range []string{"X-Stainless-Read-Timeout", "x-stainless-read-timeout"} {
		if got := send(NewTransport(nil, retrier), bg, http.Header{name: {"12"}}); got.readTimeout != "12" {
			t.Fatal(name, got)
		}
	}
	got := send(NewTransport(nil, retrier), bg, http.Header{"X-Request-Timeout": {"12"}})
	if got.requestTimeout != "12" || got.readTimeout != "600.000" {
		t.Fatal(got)
	}
}

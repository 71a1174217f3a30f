package kvgate

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

// seen is what one attempt looked like on the wire.
type seen struct {
	body           string
	retryCount     string
	readTimeout    string
	requestTimeout string
}

// scripted is a real HTTP server on loopback that answers the given statuses in turn (with
// headers and an OpenAI-shaped error body), then 200 for ever, recording every attempt.
type scripted struct {
	mu      sync.Mutex
	script  []int
	headers http.Header
	seen    []seen
	server  *httptest.Server
}

func newScripted(t *testing.T, statuses []int, headers http.Header) *scripted {
	s := &scripted{script: statuses, headers: headers}
	s.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.seen = append(s.seen, seen{string(body), r.Header.Get(HeaderRetryCount), r.Header.Get(HeaderReadTimeout), r.Header.Get(HeaderRequestTimeout)})
		status := 200
		if len(s.script) > 0 {
			status, s.script = s.script[0], s.script[1:]
		}
		s.mu.Unlock()
		if status == 200 {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"ok": true}`)
			return
		}
		for k, v := range s.headers {
			w.Header()[k] = v
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		fmt.Fprint(w, `{"error": {"code": "capacity_exceeded", "message": "full", "retry_after_ms": 1}}`)
	}))
	t.Cleanup(s.server.Close)
	return s
}

func (s *scripted) attempts() []seen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]seen(nil), s.seen...)
}

func newTestTransport(t *testing.T, clock *fakeClock, policy *Policy, budget *Budget) *Transport {
	return NewTransport(nil, mustRetrier(t, RetrierOptions{Policy: policy, Budget: budget, Clock: clock, Rand: NewRand(3)}))
}

func post(t *testing.T, tr http.RoundTripper, url, body string) *http.Response {
	t.Helper()
	resp, err := (&http.Client{Transport: tr}).Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func TestRetryableStatusesAreRetried(t *testing.T) {
	for _, status := range []int{429, 503} {
		clock := newFakeClock()
		srv := newScripted(t, []int{status, status}, nil)
		tr := newTestTransport(t, clock, nil, nil)
		resp := post(t, tr, srv.server.URL+"/v1/completions", `{"prompt":"hi"}`)
		resp.Body.Close()
		got := srv.attempts()
		if resp.StatusCode != 200 || len(got) != 3 || len(clock.slept()) != 2 {
			t.Fatalf("%d: status %d after %d attempts, %d sleeps", status, resp.StatusCode, len(got), len(clock.slept()))
		}
		// The body is replayed unchanged and retries are marked.
		for i, want := range []string{"", "1", "2"} {
			if got[i].body != `{"prompt":"hi"}` || got[i].retryCount != want {
				t.Fatalf("%d: attempt %d was %+v", status, i, got[i])
			}
		}
		if st := tr.Stats(); st.Requests != 1 || st.Attempts != 3 || st.Retries != 2 || st.Outcomes[OutcomeOK] != 1 {
			t.Fatalf("%+v", st)
		}
	}
}

func TestOtherStatusesAreNotRetried(t *testing.T) {
	// 504 is a proxy's timeout (the gateway never sends one): the generation may still be running.
	for _, status := range []int{400, 401, 403, 404, 409, 422, 500, 501, 502, 504} {
		clock := newFakeClock()
		srv := newScripted(t, []int{status}, nil)
		tr := newTestTransport(t, clock, nil, nil)
		resp := post(t, tr, srv.server.URL, "{}")
		resp.Body.Close()
		if resp.StatusCode != status || len(srv.attempts()) != 1 || len(clock.slept()) != 0 {
			t.Fatalf("%d retried", status)
		}
		if o := tr.Stats().Outcomes; o[OutcomeNotRetryable] != 1 || len(o) != 1 {
			t.Fatalf("%d: %v", status, o)
		}
	}
}

func TestServerHintIsAFloor(t *testing.T) {
	clock := newFakeClock()
	srv := newScripted(t, []int{429, 429}, http.Header{"Retry-After-Ms": {"2500"}, "Retry-After": {"3"}})
	resp := post(t, newTestTransport(t, clock, nil, nil), srv.server.URL, "{}")
	resp.Body.Close()
	slept := clock.slept()
	if resp.StatusCode != 200 || len(slept) != 2 {
		t.Fatal(resp.StatusCode, slept)
	}
	for _, d := range slept {
		if d < 2500*time.Millisecond {
			t.Fatalf("slept %v, below the 2.5 s hint", d)
		}
	}
}

func TestXShouldRetryFalseIsObeyedAndTheBodyLeftForTheCaller(t *testing.T) {
	clock := newFakeClock()
	srv := newScripted(t, []int{429}, http.Header{"X-Should-Retry": {"false"}, "Retry-After-Ms": {"10"}})
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, srv.server.URL, "{}")
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || len(srv.attempts()) != 1 || !bytes.Contains(body, []byte("capacity_exceeded")) {
		t.Fatal(resp.StatusCode, string(body))
	}
	if o := tr.Stats().Outcomes; o[OutcomeServerSaidNo] != 1 {
		t.Fatal(o)
	}
}

func TestXShouldRetryTrueOverridesTheStatusTable(t *testing.T) {
	srv := newScripted(t, []int{500}, http.Header{"X-Should-Retry": {"true"}})
	resp := post(t, newTestTransport(t, newFakeClock(), nil, nil), srv.server.URL, "{}")
	resp.Body.Close()
	if resp.StatusCode != 200 || len(srv.attempts()) != 2 {
		t.Fatal(resp.StatusCode, len(srv.attempts()))
	}
}

func TestGivesUpAfterMaxAttemptsAndReturnsTheLastResponse(t *testing.T) {
	clock := newFakeClock()
	srv := newScripted(t, []int{429, 429, 429, 429, 429, 429}, nil)
	p := DefaultPolicy()
	p.MaxAttempts = 4
	resp := post(t, newTestTransport(t, clock, &p, nil), srv.server.URL, "{}")
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || len(srv.attempts()) != 4 || len(clock.slept()) != 3 || !bytes.Contains(body, []byte("full")) {
		t.Fatal(resp.StatusCode, len(srv.attempts()), clock.slept(), string(body))
	}
}

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

func TestConnectionErrorsAreRetried(t *testing.T) {
	var mu sync.Mutex
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n <= 2 { // the connection dies before a status line
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		fmt.Fprint(w, "ok")
	}))
	defer srv.Close()
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, srv.URL, "{}")
	resp.Body.Close()
	if resp.StatusCode != 200 || calls != 3 || len(clock.slept()) != 2 {
		t.Fatal(resp.StatusCode, calls, clock.slept())
	}
}

// rawServer answers the n-th connection with replies[n] (the last one after them) once it has
// read the request, then closes it; it returns its URL and the replies sent so far.
func rawServer(t *testing.T, replies ...string) (string, func() []string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var sent []string
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			i := len(sent)
			if i >= len(replies) {
				i = len(replies) - 1
			}
			reply := replies[i]
			sent = append(sent, reply)
			mu.Unlock()
			if req, err := http.ReadRequest(bufio.NewReader(conn)); err == nil {
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(conn, reply)
			}
			conn.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return "http://" + ln.Addr().String(), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), sent...)
	}
}

const okReply = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"

// A server that read the request and closed before any status line (net/http's EOF; httpx's
// "Server disconnected without sending a response") is retried; one whose reply breaks HTTP
// is not: a reply came, so the request may have run. The Python SDK draws the same lines.
func TestOnlyAConnectionClosedWithoutAReplyIsRetried(t *testing.T) {
	url, sent := rawServer(t, "", "", okReply)
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, url, "{}")
	resp.Body.Close()
	if resp.StatusCode != 200 || len(sent()) != 3 || len(clock.slept()) != 2 {
		t.Fatal(resp.StatusCode, sent(), clock.slept())
	}
	for _, reply := range []string{
		"HTTP/1.1 abc Weird\r\nfoo\r\n\r\n", // a status code that is no number
		"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
	} {
		url, sent := rawServer(t, reply, okReply)
		tr := newTestTransport(t, newFakeClock(), nil, nil)
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) {
			t.Fatalf("%q: %v", reply, err)
		}
		if st := tr.Stats(); st.Attempts != 1 || st.Outcomes[OutcomeError] != 1 || len(sent()) != 1 {
			t.Fatalf("%q: %+v %q", reply, st, sent())
		}
	}
}

func TestRefusedConnectionsExhaustedReturnTheLastError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there any more: every dial is refused
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
	if _, err := tr.RoundTrip(req); !IsConnectionError(err) {
		t.Fatal(err)
	}
	if st := tr.Stats(); st.Attempts != 3 || st.Outcomes[OutcomeMaxAttempts] != 1 {
		t.Fatalf("%+v", st)
	}
}

// A dial that times out (a replica gone, its address dropping SYNs) never reached a server:
// it is retried like a refused one. Go reports it as an OpError that also reads as
// context.DeadlineExceeded, which must not hide the dial.
func TestDialTimeoutsAreRetried(t *testing.T) {
	base := DefaultBase()
	base.DialContext = (&net.Dialer{Deadline: time.Now().Add(-time.Second)}).DialContext
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock(), Rand: NewRand(3)}))
	req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:9/v1/chat/completions", strings.NewReader("{}"))
	_, err := tr.RoundTrip(req)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !IsConnectionError(err) {
		t.Fatal(err)
	}
	if st := tr.Stats(); st.Attempts != 3 || st.Outcomes[OutcomeMaxAttempts] != 1 {
		t.Fatalf("%+v", st)
	}
}

func TestTimeoutsAreNotRetried(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		mu.Unlock()
		<-release // the request is "running on a GPU"
	}))
	defer srv.Close()
	defer close(release)
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.ResponseHeaderTimeout = 50 * time.Millisecond
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
	_, err := tr.RoundTrip(req)
	if err == nil || IsConnectionError(err) {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 || tr.Stats().Outcomes[OutcomeError] != 1 {
		t.Fatal(calls, tr.Stats().Outcomes)
	}
}

func TestABodyThatCannotBeReplayedIsSentOnce(t *testing.T) {
	srv := newScripted(t, []int{429, 404}, nil)
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	for _, want := range []int{429, 404, 200} {
		req, _ := http.NewRequest(http.MethodPost, srv.server.URL, io.NopCloser(strings.NewReader("{}")))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatal(resp.StatusCode, want)
		}
	}
	// Each sent once; only the 429 would have been retried, and no token was spent on it.
	st := tr.Stats()
	if len(srv.attempts()) != 3 || st.Attempts != 3 || st.Budget.Retries != 0 ||
		st.Outcomes[OutcomeNotReplayable] != 1 || st.Outcomes[OutcomeNotRetryable] != 1 || st.Outcomes[OutcomeOK] != 1 {
		t.Fatalf("%d attempts, %+v", len(srv.attempts()), st)
	}
}

func TestTheCallersRequestIsNotModified(t *testing.T) {
	srv := newScripted(t, []int{503}, nil)
	req, _ := http.NewRequest(http.MethodPost, srv.server.URL, strings.NewReader("{}"))
	req.Header.Set("X-Priority", "batch")
	resp, err := newTestTransport(t, newFakeClock(), nil, nil).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if len(req.Header) != 1 || req.Header.Get(HeaderRetryCount) != "" || len(srv.attempts()) != 2 {
		t.Fatal(req.Header, len(srv.attempts()))
	}
}

func TestEmptyBudgetMeansNoRetry(t *testing.T) {
	opts := DefaultBudgetOptions()
	opts.InitialTokens = 0
	budget, _ := NewBudget(opts)
	srv := newScripted(t, []int{429}, nil)
	tr := newTestTransport(t, newFakeClock(), nil, budget)
	resp := post(t, tr, srv.server.URL, "{}")
	resp.Body.Close()
	if resp.StatusCode != 429 || len(srv.attempts()) != 1 || tr.Stats().Outcomes[OutcomeBudget] != 1 || budget.Stats().RetriesDenied != 1 {
		t.Fatal(resp.StatusCode, tr.Stats())
	}
}

// sseServer streams the given events one at a time: each is written and flushed only after the
// test has received the previous one, so a transport that buffered the body would deadlock.
type sseServer struct {
	server *httptest.Server
	next   chan struct{}
}

func newSSEServer(t *testing.T, first []int, events []string) *sseServer {
	s := &sseServer{next: make(chan struct{})}
	var mu sync.Mutex
	s.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		status := 200
		if len(first) > 0 {
			status, first = first[0], first[1:]
		}
		mu.Unlock()
		if status != 200 {
			w.Header().Set("Retry-After-Ms", "1500")
			w.WriteHeader(status)
			fmt.Fprint(w, `{"error": {"code": "capacity_exceeded", "message": "full"}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		for i, e := range events {
			if i > 0 {
				select {
				case <-s.next:
				case <-r.Context().Done():
					return
				case <-time.After(chunkWait):
					return // the client never asked: it is waiting for the whole body
				}
			}
			fmt.Fprintf(w, "data: %s\n\n", e)
			w.(http.Flusher).Flush()
		}
	}))
	t.Cleanup(func() { s.server.Close() })
	return s
}

// chunkWait bounds every wait of the chunk-by-chunk tests, so that a transport that buffers
// the body fails them instead of hanging.
const chunkWait = 5 * time.Second

// sendNext asks the server for the next event.
func (s *sseServer) sendNext(t *testing.T) {
	t.Helper()
	select {
	case s.next <- struct{}{}:
	case <-time.After(chunkWait):
		t.Fatal("the server stopped waiting for the client: the body was buffered")
	}
}

// readWithin reads from r until it has n bytes, failing the test after a second (the next
// event is sent only when the test asks for it, so waiting longer cannot help).
func readWithin(t *testing.T, r io.Reader, n int) string {
	t.Helper()
	type result struct {
		b   []byte
		err error
	}
	ch := make(chan result, 1)
	go func() {
		b := make([]byte, n)
		_, err := io.ReadFull(r, b)
		ch <- result{b, err}
	}()
	select {
	case res := <-ch:
		if res.err != nil {
			t.Fatal(res.err)
		}
		return string(res.b)
	case <-time.After(chunkWait):
		t.Fatal("a chunk already sent did not reach the caller: the body is buffered")
	}
	return ""
}

func TestAStreamIsPassedThroughChunkByChunk(t *testing.T) {
	events := []string{`{"n": 1}`, `{"n": 2}`, `{"n": 3}`}
	srv := newSSEServer(t, []int{429}, events)
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, srv.server.URL, "{}")
	defer resp.Body.Close()
	if resp.StatusCode != 200 || len(clock.slept()) != 1 || clock.slept()[0] < 1500*time.Millisecond {
		t.Fatal(resp.StatusCode, clock.slept())
	}
	for i, e := range events {
		if i > 0 {
			srv.sendNext(t)
		}
		want := "data: " + e + "\n\n"
		if got := readWithin(t, resp.Body, len(want)); got != want {
			t.Fatalf("chunk %d: %q", i, got)
		}
	}
}

func TestNoRetryOnceTheBodyBelongsToTheCaller(t *testing.T) {
	var mu sync.Mutex
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		mu.Unlock()
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(200)
		fmt.Fprint(w, "partial")
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close() // the connection dies in the middle of the body
	}))
	defer srv.Close()
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	resp := post(t, tr, srv.URL, "{}")
	_, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	if err == nil || calls != 1 || tr.Stats().Attempts != 1 {
		t.Fatal(err, calls, tr.Stats())
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

// NewHTTPClient(nil, nil), like NewClient, sends through DefaultBase's settings, not
// http.DefaultTransport's (2 idle connections per host, no response-header timeout).
func TestNoBaseMeansDefaultBase(t *testing.T) {
	for _, rt := range []http.RoundTripper{NewHTTPClient(nil, nil).Transport, NewTransport(nil, nil)} {
		base, ok := rt.(*Transport).Base().(*http.Transport)
		if !ok || base == http.DefaultTransport || base.MaxIdleConnsPerHost != 100 ||
			base.ResponseHeaderTimeout != 600*time.Second || base.IdleConnTimeout != DefaultIdleConnTimeout {
			t.Fatalf("%T %+v", rt.(*Transport).Base(), rt.(*Transport).Base())
		}
	}
}

// The client drops an idle connection before the gateway does (its keep-alive is 75 s by
// default), so that no request goes out on a connection the gateway is closing.
func TestIdleConnectionsCloseBeforeTheGatewaysKeepAlive(t *testing.T) {
	if idle := DefaultBase().IdleConnTimeout; idle <= 0 || idle >= 75*time.Second {
		t.Fatal(idle)
	}
}

// serverClosedIdle is net/http's errServerClosedIdle, unexported: what a POST on a kept-alive
// connection returns when the server closed it, as idle, as the request went out.
var serverClosedIdle = errors.New("http: server closed idle connection")

func TestAConnectionTheServerClosedAsIdleIsRetried(t *testing.T) {
	calls := 0
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		calls++
		if calls == 1 {
			return nil, serverClosedIdle
		}
		return stubResponse(req, 200, nil), nil
	})
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
	req, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil || resp.StatusCode != 200 || calls != 2 {
		t.Fatal(err, calls)
	}
	wrapped := &url.Error{Op: "Post", URL: "http://gw/v1/chat/completions", Err: serverClosedIdle}
	if !IsConnectionError(wrapped) {
		t.Fatal("a wrapped one is a connection error too")
	}
}

// A certificate that fails verification fails every attempt the same way: the server's own,
// or an https proxy's (which net/http reports as a "proxyconnect" error, like a refused dial
// to the proxy).
func TestACertificateThatFailsVerificationIsNotRetried(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "{}")
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshakes the client aborts
	srv.StartTLS()
	defer srv.Close()
	direct := DefaultBase()
	viaProxy := DefaultBase()
	viaProxy.Proxy = http.ProxyURL(mustParse(t, srv.URL))
	for name, c := range map[string]struct {
		base *http.Transport
		url  string
	}{"direct": {direct, srv.URL}, "https proxy": {viaProxy, "http://gateway.invalid/v1/chat/completions"}} {
		tr := NewTransport(c.base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
		req, _ := http.NewRequest(http.MethodPost, c.url, strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) || !isCertificateError(err) {
			t.Fatalf("%s: %v", name, err)
		}
		if st := tr.Stats(); st.Attempts != 1 || st.Outcomes[OutcomeError] != 1 {
			t.Fatalf("%s: %+v", name, st)
		}
	}
}

// A proxy that cannot be reached is a connection error (the request reached no one); one that
// refuses the tunnel answers the same on every attempt. The Python SDK draws the same lines.
func TestProxiesThatCannotBeReachedAreRetriedOnesThatRefuseAreNot(t *testing.T) {
	var mu sync.Mutex
	connects := 0
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		connects++
		mu.Unlock()
		w.WriteHeader(http.StatusProxyAuthRequired)
	}))
	defer refusing.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there any more: every dial is refused
	for _, c := range []struct {
		proxy     string
		attempts  int64
		retryable bool
	}{{refusing.URL, 1, false}, {gone, MaxAttempts, true}} {
		base := DefaultBase()
		base.Proxy = http.ProxyURL(mustParse(t, c.proxy))
		tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
		req, _ := http.NewRequest(http.MethodPost, "https://gateway.invalid/v1/chat/completions", strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) != c.retryable || tr.Stats().Attempts != c.attempts {
			t.Fatalf("%s: %v %+v", c.proxy, err, tr.Stats())
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if connects != 1 {
		t.Fatal(connects)
	}
}

func mustParse(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

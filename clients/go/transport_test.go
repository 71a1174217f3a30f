// Which answers the Transport retries and what it hands the caller: the retryable statuses
// (429, 503) and no others, the server's wait as a floor, X-Should-Retry obeyed either way, the
// last response after the last attempt, a body that cannot be replayed sent once, the caller's
// request left as it was, an empty retry budget meaning no retry, and a stream passed through
// chunk by chunk, never retried once its body belongs to the caller.

package kvgate

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

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
	srv := newCounted(t, func(w http.ResponseWriter, r *http.Request, n int) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(200)
		fmt.Fprint(w, "partial")
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close() // the connection dies in the middle of the body
	})
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	resp := post(t, tr, srv.URL, "{}")
	_, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil || srv.calls() != 1 || tr.Stats().Attempts != 1 {
		t.Fatal(err, srv.calls(), tr.Stats())
	}
}

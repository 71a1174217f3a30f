// The test servers the Transport's and the Client's tests share, all real HTTP servers on
// loopback: scripted (answers a list of statuses in turn, then 200, recording what each attempt
// carried), sseServer (streams events one at a time, each only when the test asks for it) and
// fakeGateway (answers as kvgate's gateway does, recording the bodies and headers it got); the
// Transport and Client built on them with a fake clock, counted (numbers the requests it gets,
// for a test's own handler), and chunkWait, the bound on every wait
// of the tests that check a stream reaches the caller chunk by chunk.

package kvgate

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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

// counted is a real HTTP server on loopback that numbers the requests it gets (from 1), hands
// each to handle with its number, and says how many came (calls).
type counted struct {
	mu sync.Mutex
	n  int
	*httptest.Server
}

func newCounted(t *testing.T, handle func(w http.ResponseWriter, r *http.Request, n int)) *counted {
	c := &counted{}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		c.n++
		n := c.n
		c.mu.Unlock()
		handle(w, r, n)
	}))
	t.Cleanup(c.Close)
	return c
}

func (c *counted) calls() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
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

// fakeGateway answers like kvgate's gateway: OpenAI-shaped bodies, the 429 protocol's headers.
type fakeGateway struct {
	mu       sync.Mutex
	bodies   []map[string]interface{}
	auth     []string
	priority []string
	server   *httptest.Server
}

func newFakeGateway(t *testing.T, handle func(w http.ResponseWriter, body map[string]interface{}, n int)) *fakeGateway {
	g := &fakeGateway{}
	g.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]interface{}
		_ = json.NewDecoder(r.Body).Decode(&body)
		g.mu.Lock()
		g.bodies = append(g.bodies, body)
		g.auth = append(g.auth, r.Header.Get("Authorization"))
		g.priority = append(g.priority, r.Header.Get("X-Priority"))
		n := len(g.bodies)
		g.mu.Unlock()
		body["path"] = r.URL.Path
		handle(w, body, n)
	}))
	t.Cleanup(g.server.Close)
	return g
}

func newTestClient(t *testing.T, g *fakeGateway, clock *fakeClock) *Client {
	return NewClient(g.server.URL+"/v1", ClientOptions{
		APIKey:  "sk-test",
		Retrier: mustRetrier(t, RetrierOptions{Clock: clock, Rand: NewRand(5)}),
		Header:  http.Header{"X-Priority": {"batch"}},
	})
}

func recvWithin(t *testing.T, s *Stream[ChatCompletionChunk]) (ChatCompletionChunk, error) {
	t.Helper()
	type result struct {
		c   ChatCompletionChunk
		err error
	}
	ch := make(chan result, 1)
	go func() {
		c, err := s.Recv()
		ch <- result{c, err}
	}()
	select {
	case r := <-ch:
		return r.c, r.err
	case <-time.After(chunkWait):
		t.Fatal("an event already sent did not reach the caller: the stream is buffered")
	}
	return ChatCompletionChunk{}, nil
}

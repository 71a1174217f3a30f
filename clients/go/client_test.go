package kvgate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"
)

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

func reject429(w http.ResponseWriter) {
	w.Header().Set("Retry-After", "4")
	w.Header().Set("Retry-After-Ms", "3500")
	w.Header().Set("X-RateLimit-Backpressure-Level", "RED")
	w.Header().Set("X-Queue-Depth", "142")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(429)
	fmt.Fprint(w, `{"error": {"message": "Cluster KV-Cache is currently saturated.", "type": "rate_limit_error", "param": null, "code": "capacity_exceeded", "retry_after_ms": 3500}}`)
}

func TestChatCompletionAfterA429(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		if n == 1 {
			reject429(w)
			return
		}
		w.Header().Set("X-Request-Id", "req-1")
		fmt.Fprint(w, `{"id": "c1", "object": "chat.completion", "model": "demo", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}`)
	})
	clock := newFakeClock()
	c := newTestClient(t, g, clock)
	temp := 0.5
	out, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{
		Model: "demo", Messages: []Message{{Role: "user", Content: "hi"}}, MaxTokens: 8,
		Temperature: &temp, Extra: map[string]interface{}{"seed": 7, "model": "ignored", "stream": true},
	})
	if err != nil {
		t.Fatal(err)
	}
	if out.Choices[0].Message.Content != "hello" || out.Usage.TotalTokens != 4 || out.Header.Get("X-Request-Id") != "req-1" {
		t.Fatalf("%+v", out)
	}
	if s := clock.slept(); len(s) != 1 || s[0] < 3500*time.Millisecond {
		t.Fatal(s)
	}
	body := g.bodies[1]
	if body["model"] != "demo" || body["stream"] != false || body["max_tokens"] != 8.0 || body["seed"] != 7.0 ||
		body["temperature"] != 0.5 || body["path"] != "/v1/chat/completions" {
		t.Fatalf("%v", body)
	}
	if g.auth[1] != "Bearer sk-test" || g.priority[1] != "batch" {
		t.Fatal(g.auth, g.priority)
	}
}

func TestRateLimitErrorCarriesTheProtocol(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) { reject429(w) })
	c := newTestClient(t, g, newFakeClock())
	_, err := c.Completion(context.Background(), CompletionRequest{Model: "demo", Prompt: "hi"})
	var rl *RateLimitError
	if !errors.As(err, &rl) {
		t.Fatalf("%T %v", err, err)
	}
	if rl.StatusCode != 429 || rl.Code != CodeCapacityExceeded || rl.RetryAfter != 3500*time.Millisecond ||
		rl.BackpressureLevel != "RED" || rl.QueueDepth != 142 || rl.Type != "rate_limit_error" ||
		!strings.Contains(rl.Message, "saturated") {
		t.Fatalf("%+v", rl)
	}
	var api *APIError
	if !errors.As(err, &api) || api.Code != CodeCapacityExceeded {
		t.Fatal("a RateLimitError is also an APIError")
	}
	if len(g.bodies) != MaxAttempts || g.bodies[0]["path"] != "/v1/completions" {
		t.Fatal(len(g.bodies))
	}
	if st := c.Stats(); st.Requests != 1 || st.Attempts != MaxAttempts || st.Outcomes[OutcomeMaxAttempts] != 1 {
		t.Fatalf("%+v", st)
	}
}

func TestQuotaRejectionWithoutZoneHeaders(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-Should-Retry", "false")
		w.WriteHeader(429)
		fmt.Fprint(w, `{"error": {"message": "quota", "code": "rate_limit_exceeded", "retry_after_ms": 250}}`)
	})
	_, err := newTestClient(t, g, newFakeClock()).Completion(context.Background(), CompletionRequest{Model: "m", Prompt: "p"})
	var rl *RateLimitError
	if !errors.As(err, &rl) || rl.Code != CodeRateLimitExceeded || rl.RetryAfter != 250*time.Millisecond ||
		rl.QueueDepth != -1 || rl.BackpressureLevel != "" || len(g.bodies) != 1 {
		t.Fatalf("%+v %d", rl, len(g.bodies))
	}
}

func TestASpentQuotaThatNeverRefillsIsARateLimitErrorNotRetried(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-Should-Retry", "false")
		w.WriteHeader(429)
		fmt.Fprint(w, `{"error": {"message": "spent", "type": "insufficient_quota", "code": "insufficient_quota"}}`)
	})
	_, err := newTestClient(t, g, newFakeClock()).Completion(context.Background(), CompletionRequest{Model: "m", Prompt: "p"})
	var rl *RateLimitError
	if !errors.As(err, &rl) || rl.Code != CodeInsufficientQuota || rl.RetryAfter != 0 || len(g.bodies) != 1 {
		t.Fatalf("%+v %d", rl, len(g.bodies))
	}
}

func TestOtherErrorsAreAPIErrors(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		if body["model"] == "text" {
			w.WriteHeader(502)
			fmt.Fprint(w, "bad gateway")
			return
		}
		w.Header().Set("X-Should-Retry", "false")
		w.WriteHeader(400)
		fmt.Fprint(w, `{"error": {"message": "too big", "type": "invalid_request_error", "param": "max_tokens", "code": "exceeds_burst"}}`)
	})
	c := newTestClient(t, g, newFakeClock())
	_, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "demo"})
	var api *APIError
	var rl *RateLimitError
	if !errors.As(err, &api) || errors.As(err, &rl) || api.StatusCode != 400 || api.Code != "exceeds_burst" ||
		api.Param != "max_tokens" || api.Message != "too big" || api.RetryAfter != 0 {
		t.Fatalf("%T %+v", err, err)
	}
	_, err = c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "text"})
	if !errors.As(err, &api) || api.StatusCode != 502 || api.Message != "HTTP 502" || string(api.Body) != "bad gateway" {
		t.Fatalf("%+v", err)
	}
	if !strings.Contains(err.Error(), "502") {
		t.Fatal(err)
	}
}

func TestChatStreamChunkByChunkAfterA429(t *testing.T) {
	events := []string{
		`{"id": "s", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": " t0"}}]}`,
		`{"id": "s", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " t1"}, "finish_reason": "length"}]}`,
		`{"id": "s", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}`,
		`[DONE]`,
	}
	srv := newSSEServer(t, []int{429}, events)
	clock := newFakeClock()
	c := NewClient(srv.server.URL, ClientOptions{Retrier: mustRetrier(t, RetrierOptions{Clock: clock})})
	stream, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{
		Model: "demo", Messages: []Message{{Role: "user", Content: "hi"}}, StreamOptions: &StreamOptions{IncludeUsage: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var text string
	for i := 0; ; i++ {
		if i > 0 && i < len(events) {
			srv.sendNext(t) // the next event is sent only once this one was received
		}
		chunk, err := recvWithin(t, stream)
		if err == io.EOF {
			if i != len(events)-1 {
				t.Fatalf("EOF after %d events", i)
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(chunk.Choices) > 0 {
			text += chunk.Choices[0].Delta.Content
		} else if chunk.Usage == nil || chunk.Usage.CompletionTokens != 2 {
			t.Fatalf("%+v", chunk)
		}
	}
	if text != " t0 t1" || len(clock.slept()) != 1 || clock.slept()[0] < 1500*time.Millisecond {
		t.Fatal(text, clock.slept())
	}
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

func TestCompletionStreamAndErrorEvent(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		if body["stream"] != true {
			w.WriteHeader(400)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, ": keep-alive\n\ndata: {\"choices\": [{\"index\": 0, \"text\": \"a\"}]}\r\n\r\n")
		fmt.Fprint(w, "data: {\"error\": {\"message\": \"engine died\"}}\n\n")
	})
	stream, err := newTestClient(t, g, newFakeClock()).CompletionStream(context.Background(), CompletionRequest{Model: "m", Prompt: "p"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	first, err := stream.Recv()
	if err != nil || first.Choices[0].Text != "a" {
		t.Fatal(first, err)
	}
	_, err = stream.Recv()
	var se *StreamError
	if !errors.As(err, &se) || !strings.Contains(string(se.Payload), "engine died") {
		t.Fatalf("%T %v", err, err)
	}
}

// OpenAI-compatible servers may put "error": null in every normal chunk; only a value there
// ends the stream.
func TestAnErrorMemberThatIsNullIsNoError(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"error\": null, \"choices\": [{\"index\": 0, \"delta\": {\"content\": \"a\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"b\"}}], \"error\" :  null }\n\n")
		fmt.Fprint(w, "data: {\"error\": {\"message\": \"engine died\", \"code\": \"x\"}}\n\n")
	})
	stream, err := newTestClient(t, g, newFakeClock()).ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for _, want := range []string{"a", "b"} {
		if chunk, err := stream.Recv(); err != nil || chunk.Choices[0].Delta.Content != want {
			t.Fatalf("want %q: %+v %v", want, chunk, err)
		}
	}
	_, err = stream.Recv()
	var se *StreamError
	if !errors.As(err, &se) || se.Code != "x" || se.Message != "engine died" {
		t.Fatalf("%T %v", err, err)
	}
}

func TestABodyThatIsNotJSONIsNotAConnectionError(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-Request-Id", "t-1")
		fmt.Fprint(w, "<html>a proxy's page</html>")
	})
	_, err := newTestClient(t, g, newFakeClock()).ChatCompletion(context.Background(), ChatCompletionRequest{Model: "m"})
	var ce *ConnectionError
	var ire *InvalidResponseError
	if err == nil || errors.As(err, &ce) || !strings.Contains(err.Error(), "not the expected JSON") ||
		!errors.As(err, &ire) || ire.StatusCode != 200 || string(ire.Body) != "<html>a proxy's page</html>" ||
		ire.RequestID != "t-1" || ire.Err == nil {
		t.Fatalf("%T %v", err, err)
	}
}

// A 2xx that is no event stream (a proxy's page, a server that ignored "stream" and sent a
// whole answer, bigger than what is read of it) is an error, not a stream of no events.
func TestAStreamThatIsNoEventStreamIsAnInvalidResponse(t *testing.T) {
	page := "<html>Please sign in to the network</html>"
	whole := `{"choices": [{"text": "` + strings.Repeat("x", 4*notAStreamPrefix) + `"}]}`
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-Request-Id", fmt.Sprintf("t-%d", n))
		if body["path"] == "/v1/completions" {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, whole)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprint(w, page)
	})
	c := newTestClient(t, g, newFakeClock())
	_, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	var ire *InvalidResponseError
	if !errors.As(err, &ire) || ire.StatusCode != 200 || string(ire.Body) != page || ire.RequestID != "t-1" ||
		!strings.Contains(err.Error(), `not an event stream (Content-Type "text/html; charset=utf-8")`) {
		t.Fatalf("%T %v", err, err)
	}
	_, err = c.CompletionStream(context.Background(), CompletionRequest{Model: "m"})
	if !errors.As(err, &ire) || string(ire.Body) != whole[:notAStreamPrefix] {
		t.Fatalf("%T %v", err, err)
	}
	if st := c.Stats(); st.Attempts != 2 {
		t.Fatalf("%+v", st)
	}
}

// A body that ends cleanly before data: [DONE] is an answer cut short: the events it carried,
// then the same error as a connection that broke mid-stream, never retried.
func TestAStreamThatEndsBeforeDoneIsIncomplete(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"a\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"b\"}}]}\n\n")
	})
	c := newTestClient(t, g, newFakeClock())
	stream, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for _, want := range []string{"a", "b"} {
		if chunk, err := stream.Recv(); err != nil || chunk.Choices[0].Delta.Content != want {
			t.Fatalf("want %q: %+v %v", want, chunk, err)
		}
	}
	_, err = stream.Recv()
	var ce *ConnectionError
	if !errors.As(err, &ce) || !errors.Is(err, ErrIncompleteStream) || !strings.Contains(err.Error(), "without [DONE]") {
		t.Fatalf("%T %v", err, err)
	}
	if st := c.Stats(); st.Attempts != 1 {
		t.Fatalf("%+v", st)
	}
}

// A POST answered 301 is not followed as a GET without its body (which the gateway answers
// 405): the redirect is the error, and it says where to point the client.
func TestARedirectIsAnAPIErrorNamingItsLocation(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path)
		mu.Unlock()
		if strings.HasPrefix(r.URL.Path, "/v1/") {
			http.Redirect(w, r, "/v2/"+strings.TrimPrefix(r.URL.Path, "/v1/"), http.StatusMovedPermanently)
			return
		}
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		fmt.Fprint(w, `{"choices": []}`)
	}))
	defer srv.Close()
	c := NewClient(srv.URL+"/v1", ClientOptions{Retrier: mustRetrier(t, RetrierOptions{Clock: newFakeClock()})})
	_, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "m"})
	var api *APIError
	if !errors.As(err, &api) || api.StatusCode != 301 ||
		!strings.HasPrefix(api.Message, "redirected to /v2/chat/completions") || !strings.Contains(err.Error(), "301") {
		t.Fatalf("%T %v", err, err)
	}
	_, err = c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if !errors.As(err, &api) || api.StatusCode != 301 {
		t.Fatalf("%T %v", err, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(seen, "|") != "POST /v1/chat/completions|POST /v1/chat/completions" {
		t.Fatal(seen)
	}
}

// The rest of the 429 protocol: the code of a tenant's cap on queued tokens, the limit's
// scope, and the zone a gateway that cannot read its Redis reports.
func TestRateLimitErrorScopeAndTheQueuedTokensCode(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-RateLimit-Scope", "key")
		w.Header().Set("X-RateLimit-Backpressure-Level", "UNKNOWN")
		w.Header().Set("X-Queue-Depth", "3")
		w.Header().Set("Retry-After-Ms", "1100")
		w.Header().Set("X-Should-Retry", "false")
		w.WriteHeader(429)
		fmt.Fprint(w, `{"error": {"message": "cap", "type": "rate_limit_error", "code": "rate_limit_exceeded_queued_tokens"}}`)
	})
	_, err := newTestClient(t, g, newFakeClock()).Completion(context.Background(), CompletionRequest{Model: "m", Prompt: "p"})
	var rl *RateLimitError
	if !errors.As(err, &rl) || rl.Code != CodeQueuedTokensExceeded || rl.Scope != "key" ||
		rl.BackpressureLevel != "UNKNOWN" || rl.QueueDepth != 3 || rl.RetryAfter != 1100*time.Millisecond {
		t.Fatalf("%T %+v", err, err)
	}
}

func TestUnreachableGatewayIsAConnectionError(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	url := "http://" + ln.Addr().String() + "/v1"
	ln.Close()
	c := NewClient(url, ClientOptions{Retrier: mustRetrier(t, RetrierOptions{Clock: newFakeClock()})})
	_, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "m"})
	var ce *ConnectionError
	if !errors.As(err, &ce) || !IsConnectionError(ce.Err) || c.Stats().Attempts != MaxAttempts {
		t.Fatalf("%T %v %+v", err, err, c.Stats())
	}
}

func TestSSEReader(t *testing.T) {
	in := ": comment\n\ndata: a\ndata: b\n\nevent: x\ndata:c\r\n\r\nid: 3\n\n\ndata: last"
	if got := readEvents(t, newSSEReader(strings.NewReader(in+"\n\ndata: [DONE]"))); strings.Join(got, "|") != "a\nb|c|last" {
		t.Fatalf("%q", got)
	}
	// The same events without [DONE]: all delivered, then the end is an error, not io.EOF.
	r := newSSEReader(strings.NewReader(in))
	for _, want := range []string{"a\nb", "c", "last"} {
		if d, err := r.next(); d != want || err != nil {
			t.Fatalf("want %q: %q %v", want, d, err)
		}
	}
	for i := 0; i < 2; i++ {
		if _, err := r.next(); !errors.Is(err, ErrIncompleteStream) {
			t.Fatal(err)
		}
	}
	r = newSSEReader(strings.NewReader("data: x\n\ndata: [DONE]\n\ndata: after\n\n"))
	if d, _ := r.next(); d != "x" {
		t.Fatal(d)
	}
	if _, err := r.next(); err != io.EOF {
		t.Fatal(err)
	}
	if _, err := r.next(); err != io.EOF {
		t.Fatal("events after [DONE] are not read")
	}
	r = newSSEReader(strings.NewReader("data: " + strings.Repeat("x", maxSSELine+1) + "\n\n"))
	if _, err := r.next(); !errors.Is(err, errLineTooLong) {
		t.Fatal(err)
	}
}

// readEvents is every event's data until the end of the stream (or [DONE]).
func readEvents(t *testing.T, r *sseReader) []string {
	t.Helper()
	var got []string
	for {
		d, err := r.next()
		if err == io.EOF {
			return got
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, d)
	}
}

// The SSE grammar ends a line at CR, LF or CRLF; events framed any of these ways, split
// anywhere (one byte per read included), read the same.
func TestSSEReaderLineEnds(t *testing.T) {
	for _, in := range []string{
		"data: a\r\rdata: b1\rdata: b2\r\r: c\r\rdata: [DONE]\r\rdata: after\r\r",
		"data: a\r\n\r\ndata: b1\r\ndata: b2\n\r: c\n\ndata: [DONE]\r\n\r\n",
		"data: a\n\ndata: b1\rdata: b2\r\n\n: c\r\rdata: [DONE]\n\n",
	} {
		for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in))} {
			if got := readEvents(t, newSSEReader(r)); strings.Join(got, "|") != "a|b1\nb2" {
				t.Fatalf("%q: %q", in, got)
			}
		}
	}
}

// stalling serves its chunks one per read, then blocks, as a server that waits does.
type stalling struct {
	chunks []string
	stop   chan struct{}
}

func (r *stalling) Read(p []byte) (int, error) {
	if len(r.chunks) == 0 {
		<-r.stop
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	r.chunks = r.chunks[1:]
	return n, nil
}

// The CR of a CRLF ends one read and its LF starts the next, which also holds the blank line
// that ends the event: the event is returned from what was read, without waiting for more
// (skipping the LF alone made the scanner read again first, and the event waited for the
// server's next write).
func TestAnEventWhoseCRLFIsSplitBetweenReadsIsNotHeldBack(t *testing.T) {
	r := &stalling{chunks: []string{"data: b\r", "\n\r\n"}, stop: make(chan struct{})}
	defer close(r.stop)
	got := make(chan string, 1)
	go func() {
		data, _ := newSSEReader(r).next()
		got <- data
	}()
	select {
	case data := <-got:
		if data != "b" {
			t.Fatalf("%q", data)
		}
	case <-time.After(chunkWait):
		t.Fatal("the event waited for a read after the one that completed it")
	}
}

// A stream framed by bare CRs reaches the caller event by event, each as soon as the CR that
// ends it has arrived (the server writes nothing more until the test asks), and a CRLF split
// between two writes is one line end.
func TestStreamFramedByBareCRChunkByChunk(t *testing.T) {
	next := make(chan struct{})
	event := func(text string) string {
		return `data: {"choices": [{"index": 0, "delta": {"content": "` + text + `"}}]}`
	}
	writes := []string{event("a") + "\r\r", event("b") + "\r", "\n\r\n: keep-alive\r" + event("c") + "\r\r", "data: [DONE]\r\r"}
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i, chunk := range writes {
			if i > 0 {
				select {
				case <-next:
				case <-time.After(chunkWait):
					return
				}
			}
			fmt.Fprint(w, chunk)
			w.(http.Flusher).Flush()
		}
	})
	stream, err := newTestClient(t, g, newFakeClock()).ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	send := func() {
		select {
		case next <- struct{}{}:
		case <-time.After(chunkWait):
			t.Fatal("the server stopped waiting for the client")
		}
	}
	if chunk, err := recvWithin(t, stream); err != nil || chunk.Choices[0].Delta.Content != "a" {
		t.Fatalf("%+v %v", chunk, err)
	}
	send()
	send()
	for _, want := range []string{"b", "c"} {
		if chunk, err := recvWithin(t, stream); err != nil || chunk.Choices[0].Delta.Content != want {
			t.Fatalf("want %q: %+v %v", want, chunk, err)
		}
	}
	send()
	if _, err := recvWithin(t, stream); err != io.EOF {
		t.Fatal(err)
	}
}

func TestDefaultsFromTheEnvironment(t *testing.T) {
	t.Setenv("KVGATE_API_KEY", "")
	t.Setenv("OPENAI_API_KEY", "sk-env")
	t.Setenv("KVGATE_BASE_URL", "")
	c := NewClient("", ClientOptions{})
	if c.baseURL != "http://localhost:8080/v1" || c.apiKey != "sk-env" || c.Transport().Retrier().Policy().MaxAttempts != MaxAttempts {
		t.Fatal(c.baseURL, c.apiKey)
	}
	t.Setenv("KVGATE_BASE_URL", "http://gateway:9000/v1")
	if c := NewClient("", ClientOptions{}); c.baseURL != "http://gateway:9000/v1" {
		t.Fatal(c.baseURL)
	}
	if c := NewClient("http://other/v1", ClientOptions{}); c.baseURL != "http://other/v1" {
		t.Fatal(c.baseURL)
	}
}

// The gateway's answers name their task in X-Request-Id, and a stream that breaks off ends
// with an OpenAI-shaped error event: both reach the caller as fields, not only as raw bytes.
func TestErrorsCarryTheRequestIDAndTheErrorEventsFields(t *testing.T) {
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("X-Request-Id", fmt.Sprintf("task-%d", n))
		if body["stream"] != true {
			w.Header().Set("Retry-After-Ms", "1042")
			w.WriteHeader(502)
			fmt.Fprint(w, `{"error": {"message": "The inference node failed.", "type": "server_error", "param": null, "code": "upstream_error", "retry_after_ms": 1042}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"t0\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"error\": {\"message\": \"The inference node broke off the stream.\", \"type\": \"server_error\", \"param\": null, \"code\": \"upstream_broken_stream\"}}\n\ndata: [DONE]\n\n")
	})
	c := newTestClient(t, g, newFakeClock())
	_, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "demo"})
	var api *APIError
	if !errors.As(err, &api) || api.StatusCode != 502 || api.Code != "upstream_error" || api.RequestID != "task-1" {
		t.Fatalf("%T %+v", err, err)
	}
	stream, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "demo"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if chunk, err := stream.Recv(); err != nil || chunk.Choices[0].Delta.Content != "t0" {
		t.Fatal(chunk, err)
	}
	_, err = stream.Recv()
	var se *StreamError
	if !errors.As(err, &se) || se.Code != "upstream_broken_stream" || se.Type != "server_error" ||
		se.Message != "The inference node broke off the stream." || se.Param != "" || se.RequestID != "task-2" ||
		!strings.Contains(se.Error(), "task-2") {
		t.Fatalf("%T %+v", err, err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatal(err)
	}
}

// The SSE grammar allows a byte order mark before the stream's first line; left on that line it
// would hide the first event's field name, and the first chunk would be lost. The Python SDK
// strips it too; a later one is no BOM but part of its line.
func TestALeadingByteOrderMarkIsNotPartOfTheFirstEvent(t *testing.T) {
	in := "\ufeffdata: a\n\n\ufeffdata: b\n\ndata: c\n\ndata: [DONE]\n\n"
	for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in))} {
		if got := readEvents(t, newSSEReader(r)); strings.Join(got, "|") != "a|c" {
			t.Fatalf("%q", got)
		}
	}
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "\ufeffdata: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"first\"}}]}\n\ndata: [DONE]\n\n")
	})
	stream, err := newTestClient(t, g, newFakeClock()).ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if chunk, err := stream.Recv(); err != nil || len(chunk.Choices) != 1 || chunk.Choices[0].Delta.Content != "first" {
		t.Fatalf("%+v %v", chunk, err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatal(err)
	}
}

// An event whose payload is JSON but no object (null above all, which decodes into a chunk as
// nothing) is no chunk: a caller's loop would index an empty Choices. Python raises
// StreamError for it too.
func TestAnEventThatIsNotAJSONObjectIsAStreamError(t *testing.T) {
	for _, data := range []string{"null", " null ", "42", `"text"`, "[1]"} {
		g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("X-Request-Id", "t-9")
			fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", data)
		})
		c := newTestClient(t, g, newFakeClock())
		chat, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		chunk, err := chat.Recv()
		chat.Close()
		var se *StreamError
		if !errors.As(err, &se) || strings.TrimSpace(string(se.Payload)) != strings.TrimSpace(data) || se.RequestID != "t-9" {
			t.Fatalf("%q: %T %v %+v", data, err, err, chunk)
		}
		completion, err := c.CompletionStream(context.Background(), CompletionRequest{Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = completion.Recv()
		completion.Close()
		if !errors.As(err, &se) {
			t.Fatalf("%q: %T %v", data, err, err)
		}
	}
}

// A 200 whose body is null is no answer, though json.Unmarshal reads it into a struct without
// an error; Python raises InvalidResponseError for it too.
func TestASuccessWhoseBodyIsNullIsAnInvalidResponse(t *testing.T) {
	for _, raw := range []string{"null", " null\n"} {
		g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Request-Id", "t-3")
			fmt.Fprint(w, raw)
		})
		c := newTestClient(t, g, newFakeClock())
		answer, err := c.ChatCompletion(context.Background(), ChatCompletionRequest{Model: "m"})
		var ire *InvalidResponseError
		if !errors.As(err, &ire) || ire.StatusCode != 200 || string(ire.Body) != raw || ire.RequestID != "t-3" ||
			!strings.Contains(err.Error(), "not the expected JSON") {
			t.Fatalf("%q: %T %v %+v", raw, err, err, answer)
		}
		if _, err := c.Completion(context.Background(), CompletionRequest{Model: "m"}); !errors.As(err, &ire) {
			t.Fatalf("%q: %T %v", raw, err, err)
		}
	}
}

// The wait an error reports is the one the retry policy read: the headers first, then the
// body's retry_after_ms. Python's retry_after_ms takes the same order.
func TestTheReportedWaitReadsTheHeadersFirst(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	body := []byte(`{"error": {"code": "capacity_exceeded", "retry_after_ms": 3000}}`)
	for _, c := range []struct {
		header http.Header
		want   time.Duration
	}{
		{http.Header{"Retry-After-Ms": {"1200"}}, 1200 * time.Millisecond},
		{http.Header{"Retry-After": {"2"}}, 2 * time.Second},
		{http.Header{"Retry-After-Ms": {"soon"}}, 3 * time.Second}, // no hint in the headers
		{http.Header{}, 3 * time.Second},
	} {
		var rl *RateLimitError
		if err := newAPIError(429, c.header, body, now); !errors.As(err, &rl) || rl.RetryAfter != c.want {
			t.Fatalf("%v: %v, want %v", c.header, err, c.want)
		}
	}
}

// A client printed with any verb, on its own or inside a struct, shows no API key: a log line
// or a dump of a struct holding the client would otherwise carry it.
func TestAPrintedClientRedactsItsAPIKey(t *testing.T) {
	const key = "sk-secret-1234"
	c := NewClient("http://gw/v1", ClientOptions{APIKey: key, Header: http.Header{"Authorization": {"Bearer " + key}}})
	holder := struct{ Client Client }{*c}
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%d"} {
		for _, arg := range []interface{}{c, *c, holder, &holder} {
			got := fmt.Sprintf(verb, arg)
			if strings.Contains(got, key) || strings.Contains(got, fmt.Sprintf("%x", key)) ||
				!strings.Contains(got, "redacted") {
				t.Fatalf("%s of %T: %s", verb, arg, got)
			}
		}
	}
	if got := c.String(); got != `kvgate.Client{baseURL: "http://gw/v1", apiKey: redacted}` {
		t.Fatal(got)
	}
	t.Setenv("KVGATE_API_KEY", "")
	t.Setenv("OPENAI_API_KEY", "")
	if got := fmt.Sprint(NewClient("http://gw/v1", ClientOptions{})); got != `kvgate.Client{baseURL: "http://gw/v1", apiKey: none}` {
		t.Fatal(got)
	}
}

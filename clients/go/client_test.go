// The Client's requests and the errors they end in: a chat completion sent after a 429 with
// the caller's fields and headers, the 429 protocol read into a RateLimitError (code, wait,
// zone, queue depth, scope), other statuses as APIErrors, a redirect named as one, a body that
// is not the expected JSON (or null) as an InvalidResponseError, an unreachable gateway as a
// ConnectionError, the request ID and an error event's fields on the errors, the defaults read
// from the environment, and the API key kept out of a printed client.

package kvgate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

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

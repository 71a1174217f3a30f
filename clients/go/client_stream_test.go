// The Client's streams: a chat stream that reaches the caller event by event after a 429,
// a completion stream ended by an error event (and an "error": null member that is none), and
// the streams that are not what they claim: a 2xx that is no event stream, a body that ends
// before data: [DONE], an event whose payload is no JSON object.

package kvgate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

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
	err := errorAfter(t, newTestClient(t, g, newFakeClock()), "a", "b")
	var se *StreamError
	if !errors.As(err, &se) || se.Code != "x" || se.Message != "engine died" {
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
	err := errorAfter(t, c, "a", "b")
	var ce *ConnectionError
	if !errors.As(err, &ce) || !errors.Is(err, ErrIncompleteStream) || !strings.Contains(err.Error(), "without [DONE]") {
		t.Fatalf("%T %v", err, err)
	}
	if st := c.Stats(); st.Attempts != 1 {
		t.Fatalf("%+v", st)
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

// errorAfter opens a chat stream through c, reads chunks whose contents are wants, in order,
// and returns what the next Recv fails with.
func errorAfter(t *testing.T, c *Client, wants ...string) error {
	t.Helper()
	stream, err := c.ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for _, want := range wants {
		if chunk, err := stream.Recv(); err != nil || chunk.Choices[0].Delta.Content != want {
			t.Fatalf("want %q: %+v %v", want, chunk, err)
		}
	}
	_, err = stream.Recv()
	return err
}

package kvgate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"os"
	"strings"
)

// DefaultBaseURL is where NewClient sends requests when given no base URL: a local gateway.
const DefaultBaseURL = "http://localhost:8080/v1"

// ClientOptions configures NewClient; every field is optional.
type ClientOptions struct {
	// APIKey is sent as a bearer token; "" reads $KVGATE_API_KEY, then $OPENAI_API_KEY.
	APIKey string
	// Retrier applies the retry policy; nil: NewDefaultRetrier(). Share one among clients
	// to bound their retries with one budget.
	Retrier *Retrier
	// Base is the transport below the retries; nil: DefaultBase(), a clone of
	// http.DefaultTransport with 100 idle connections per host closed after 30 s idle, a 5 s
	// connect timeout and a 600 s response-header timeout.
	Base http.RoundTripper
	// Header is sent with every request (e.g. X-Priority: batch to lower a request's tier).
	Header http.Header
}

// Client is a small typed client for kvgate's OpenAI-compatible endpoints: chat completions
// and completions, each whole or streamed. Retries happen in its Transport before a response
// is returned, so a stream is retried only while none of its body has reached the caller.
// It follows no redirect: net/http would turn a POST answered 301 or 302 into a GET without
// its body, which the gateway answers 405; the redirect is an *APIError whose Message names
// its Location instead. It is safe for concurrent use.
type Client struct {
	baseURL   string
	apiKey    string
	header    http.Header
	transport *Transport
	http      *http.Client
}

// NewClient returns a client for the API rooted at baseURL (e.g. "http://gateway:8080/v1";
// "" reads $KVGATE_BASE_URL, then DefaultBaseURL).
func NewClient(baseURL string, o ClientOptions) *Client {
	if baseURL == "" {
		baseURL = os.Getenv("KVGATE_BASE_URL")
	}
	if baseURL == "" {
		baseURL = DefaultBaseURL
	}
	key := o.APIKey
	if key == "" {
		key = os.Getenv("KVGATE_API_KEY")
	}
	if key == "" {
		key = os.Getenv("OPENAI_API_KEY")
	}
	base := o.Base
	if base == nil {
		base = DefaultBase()
	}
	t := NewTransport(base, o.Retrier)
	return &Client{
		baseURL:   strings.TrimRight(baseURL, "/"),
		apiKey:    key,
		header:    o.Header.Clone(),
		transport: t,
		http:      &http.Client{Transport: t, CheckRedirect: noRedirects},
	}
}

func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// String describes the client without its API key, which a log line or a panic's dump of a
// struct holding the client would otherwise carry: only whether one is set. The headers of
// ClientOptions.Header are left out too, since they may carry credentials of their own.
func (c Client) String() string {
	key := "none"
	if c.apiKey != "" {
		key = "redacted"
	}
	return fmt.Sprintf("kvgate.Client{baseURL: %q, apiKey: %s}", c.baseURL, key)
}

// Format prints String for every verb: without it, fmt would print the fields themselves for
// verbs that do not look for a Stringer (%d, %x, ...), the key among them.
func (c Client) Format(f fmt.State, verb rune) { _, _ = io.WriteString(f, c.String()) }

// HTTPClient returns the *http.Client the client sends with (its Transport is Transport()).
func (c *Client) HTTPClient() *http.Client { return c.http }

// Transport returns the retrying transport.
func (c *Client) Transport() *Transport { return c.transport }

// Stats returns the retry counters.
func (c *Client) Stats() Stats { return c.transport.Stats() }

// Message is one message of a chat.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	Name    string `json:"name,omitempty"`
}

// StreamOptions are the options of a streamed request.
type StreamOptions struct {
	// IncludeUsage asks for a last chunk carrying the usage of the whole request.
	IncludeUsage bool `json:"include_usage"`
}

// ChatCompletionRequest is the body of POST /chat/completions; the stream flag is set by the
// method called. Extra holds further parameters, sent as top-level members unless a field
// above already sets them.
type ChatCompletionRequest struct {
	Model         string                 `json:"model"`
	Messages      []Message              `json:"messages"`
	MaxTokens     int                    `json:"max_tokens,omitempty"`
	Temperature   *float64               `json:"temperature,omitempty"`
	TopP          *float64               `json:"top_p,omitempty"`
	Stop          []string               `json:"stop,omitempty"`
	User          string                 `json:"user,omitempty"`
	StreamOptions *StreamOptions         `json:"stream_options,omitempty"`
	Extra         map[string]interface{} `json:"-"`
}

// CompletionRequest is the body of POST /completions; see ChatCompletionRequest.
type CompletionRequest struct {
	Model         string                 `json:"model"`
	Prompt        string                 `json:"prompt"`
	MaxTokens     int                    `json:"max_tokens,omitempty"`
	Temperature   *float64               `json:"temperature,omitempty"`
	TopP          *float64               `json:"top_p,omitempty"`
	Stop          []string               `json:"stop,omitempty"`
	User          string                 `json:"user,omitempty"`
	StreamOptions *StreamOptions         `json:"stream_options,omitempty"`
	Extra         map[string]interface{} `json:"-"`
}

// Usage counts a request's tokens.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// ChatCompletion is the answer of a whole (not streamed) chat completion.
type ChatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []ChatChoice `json:"choices"`
	Usage   *Usage       `json:"usage"`
	// Header holds the response's headers (x-request-id among them).
	Header http.Header `json:"-"`
}

// ChatChoice is one choice of a ChatCompletion.
type ChatChoice struct {
	Index        int     `json:"index"`
	Message      Message `json:"message"`
	FinishReason string  `json:"finish_reason"`
}

// ChatCompletionChunk is one event of a streamed chat completion.
type ChatCompletionChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"`
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []ChatChunkChoice `json:"choices"`
	// Usage is set on the last chunk when StreamOptions.IncludeUsage was asked for.
	Usage *Usage `json:"usage"`
}

// ChatChunkChoice is one choice of a ChatCompletionChunk.
type ChatChunkChoice struct {
	Index int   `json:"index"`
	Delta Delta `json:"delta"`
	// FinishReason is "" until the choice's last chunk.
	FinishReason string `json:"finish_reason"`
}

// Delta is what a chunk adds to a chat message.
type Delta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

// Completion is the answer of a completion, whole, or one event of a streamed one.
type Completion struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []CompletionChoice `json:"choices"`
	Usage   *Usage             `json:"usage"`
	// Header holds the response's headers on a whole completion; nil on stream events.
	Header http.Header `json:"-"`
}

// CompletionChoice is one choice of a Completion.
type CompletionChoice struct {
	Index        int    `json:"index"`
	Text         string `json:"text"`
	FinishReason string `json:"finish_reason"`
}

// ChatCompletion sends a chat completion and returns the whole answer.
func (c *Client) ChatCompletion(ctx context.Context, req ChatCompletionRequest) (*ChatCompletion, error) {
	type plain ChatCompletionRequest
	body, err := encodeBody(plain(req), req.Extra, false)
	if err != nil {
		return nil, err
	}
	out := &ChatCompletion{}
	h, err := c.post(ctx, "/chat/completions", body, out)
	if err != nil {
		return nil, err
	}
	out.Header = h
	return out, nil
}

// Completion sends a completion and returns the whole answer.
func (c *Client) Completion(ctx context.Context, req CompletionRequest) (*Completion, error) {
	type plain CompletionRequest
	body, err := encodeBody(plain(req), req.Extra, false)
	if err != nil {
		return nil, err
	}
	out := &Completion{}
	h, err := c.post(ctx, "/completions", body, out)
	if err != nil {
		return nil, err
	}
	out.Header = h
	return out, nil
}

// ChatCompletionStream sends a streamed chat completion. The returned stream yields each
// chunk as soon as the server has sent it; close it when done. A success whose Content-Type is
// not text/event-stream (a proxy's page, a server that ignored "stream") is an
// *InvalidResponseError holding the first 64 KiB of its body.
func (c *Client) ChatCompletionStream(ctx context.Context, req ChatCompletionRequest) (*Stream[ChatCompletionChunk], error) {
	type plain ChatCompletionRequest
	body, err := encodeBody(plain(req), req.Extra, true)
	if err != nil {
		return nil, err
	}
	resp, err := c.sendStream(ctx, "/chat/completions", body)
	if err != nil {
		return nil, err
	}
	return newStream[ChatCompletionChunk](resp), nil
}

// CompletionStream sends a streamed completion; see ChatCompletionStream.
func (c *Client) CompletionStream(ctx context.Context, req CompletionRequest) (*Stream[Completion], error) {
	type plain CompletionRequest
	body, err := encodeBody(plain(req), req.Extra, true)
	if err != nil {
		return nil, err
	}
	resp, err := c.sendStream(ctx, "/completions", body)
	if err != nil {
		return nil, err
	}
	return newStream[Completion](resp), nil
}

// encodeBody marshals the typed fields, adds the Extra members they do not set, and sets
// "stream" last so that nothing overrides the method's choice.
func encodeBody(fields interface{}, extra map[string]interface{}, stream bool) ([]byte, error) {
	raw, err := json.Marshal(fields)
	if err != nil {
		return nil, err
	}
	members := map[string]interface{}{}
	if err := json.Unmarshal(raw, &members); err != nil {
		return nil, err
	}
	for k, v := range extra {
		if _, set := members[k]; !set {
			members[k] = v
		}
	}
	members["stream"] = stream
	return json.Marshal(members)
}

func (c *Client) post(ctx context.Context, path string, body []byte, out interface{}) (http.Header, error) {
	resp, err := c.send(ctx, path, body, "application/json")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, &ConnectionError{Err: err} // the body broke off
	}
	err = json.Unmarshal(raw, out)
	// json.Unmarshal reads null into a struct as nothing at all: the caller would get an answer
	// with no choices and no error, where the Python SDK raises InvalidResponseError.
	if err != nil || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		if len(raw) > maxErrorBody {
			raw = raw[:maxErrorBody]
		}
		return nil, &InvalidResponseError{StatusCode: resp.StatusCode, Header: resp.Header, Body: raw,
			RequestID: requestID(resp.Header), Expected: "the expected JSON", Err: err}
	}
	return resp.Header, nil
}

// notAStreamPrefix bounds what is read of a success that is no event stream: enough to tell a
// proxy's page; a server that ignored "stream" may be sending a whole answer, or more.
const notAStreamPrefix = 64 << 10

// sendStream is send for a streamed request: a response below 300 that is an event stream.
func (c *Client) sendStream(ctx context.Context, path string, body []byte) (*http.Response, error) {
	resp, err := c.send(ctx, path, body, "text/event-stream")
	if err != nil {
		return nil, err
	}
	if media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); media != "text/event-stream" {
		prefix, _ := io.ReadAll(io.LimitReader(resp.Body, notAStreamPrefix))
		_ = resp.Body.Close()
		return nil, &InvalidResponseError{StatusCode: resp.StatusCode, Header: resp.Header, Body: prefix,
			RequestID: requestID(resp.Header),
			Expected:  fmt.Sprintf("an event stream (Content-Type %q)", resp.Header.Get("Content-Type"))}
	}
	return resp, nil
}

// send posts body and returns a response below 300, or the typed error (a redirect included).
func (c *Client) send(ctx context.Context, path string, body []byte, accept string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.baseURL+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	for k, v := range c.header {
		req.Header[k] = append([]string(nil), v...)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", accept)
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &ConnectionError{Err: err}
	}
	if resp.StatusCode >= 300 {
		return nil, decodeError(resp)
	}
	return resp, nil
}

// Stream is a streamed answer: ChatCompletionChunk or Completion events, in order.
type Stream[T any] struct {
	resp *http.Response
	sse  *sseReader
}

func newStream[T any](resp *http.Response) *Stream[T] {
	return &Stream[T]{resp: resp, sse: newSSEReader(resp.Body)}
}

// Recv returns the next event as soon as it has arrived; io.EOF after the data: [DONE] event.
// A broken connection gives a *ConnectionError, and so does a body that ends before
// [DONE] (its Err is ErrIncompleteStream); an error event, or one that is not a JSON object
// (data: null among them), gives a *StreamError; none is retried.
func (s *Stream[T]) Recv() (T, error) {
	var zero T
	data, err := s.sse.next()
	if err != nil {
		if err == io.EOF {
			return zero, io.EOF
		}
		return zero, &ConnectionError{Err: err}
	}
	var probe map[string]json.RawMessage
	// A null event decodes into a nil map without an error, and into T as a zero chunk: it is
	// no chunk, and a caller indexing Choices would panic on it.
	if json.Unmarshal([]byte(data), &probe) != nil || probe == nil {
		return zero, newStreamError(json.RawMessage(data), s.resp.Header)
	}
	// OpenAI-compatible servers may send "error": null in a normal chunk: only a value is one.
	if e, ok := probe["error"]; ok && !bytes.Equal(bytes.TrimSpace(e), []byte("null")) {
		return zero, newStreamError(e, s.resp.Header)
	}
	var out T
	if err := json.Unmarshal([]byte(data), &out); err != nil {
		return zero, newStreamError(json.RawMessage(data), s.resp.Header)
	}
	return out, nil
}

// Header returns the response's headers (x-request-id among them).
func (s *Stream[T]) Header() http.Header { return s.resp.Header }

// Close releases the connection; call it when done, also after io.EOF or an early stop.
func (s *Stream[T]) Close() error {
	err := s.resp.Body.Close()
	if errors.Is(err, http.ErrBodyReadAfterClose) {
		return nil
	}
	return err
}

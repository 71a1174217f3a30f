package kvgate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Error codes of kvgate's 429 protocol, in RateLimitError.Code.
const (
	// CodeCapacityExceeded: the fleet's KV-cache is full (or the request's queue is); come
	// back after Retry-After.
	CodeCapacityExceeded = "capacity_exceeded"
	// CodeRateLimitExceeded: the API key's token quota is spent for now.
	CodeRateLimitExceeded = "rate_limit_exceeded"
	// CodeQueuedTokensExceeded: the API key's requests already queued hold its cap on queued
	// tokens; RetryAfter is the time its own queue takes to drain enough.
	CodeQueuedTokensExceeded = "rate_limit_exceeded_queued_tokens"
	// CodeInsufficientQuota: a quota that never refills is spent; no wait helps (the answer
	// says x-should-retry: false, and RetryAfter is 0).
	CodeInsufficientQuota = "insufficient_quota"
)

// maxErrorBody bounds how much of an error response is read and kept.
const maxErrorBody = 1 << 20

// APIError is an error response (status >= 400, or a redirect: the Client follows none) with
// the fields of OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, pulled
// out. A redirect's Message names its Location.
type APIError struct {
	// StatusCode is the response's HTTP status.
	StatusCode int
	// Code is the machine-readable error code ("" when the body has none).
	Code string
	// Type is OpenAI's error type, e.g. "invalid_request_error".
	Type string
	// Param names the offending request field, when the server says.
	Param string
	// Message is the server's message, or "HTTP <status>" when the body has none.
	Message string
	// RetryAfter is the wait the server asked for (headers first, then the body's
	// retry_after_ms), 0 when it asked for none.
	RetryAfter time.Duration
	// RequestID is the gateway's X-Request-Id, the task's name in its logs; "" for a
	// request refused before admission (a malformed one, or one refused before it reached
	// the admission store, as max_tokens_too_large is). Every answer of the admission step,
	// a 429 included, carries one.
	RequestID string
	// Header holds the response's headers.
	Header http.Header
	// Body holds the response's body (at most 1 MiB of it).
	Body []byte
}

// Error describes the error: status, code and message.
func (e *APIError) Error() string {
	if e.Code != "" {
		return fmt.Sprintf("kvgate: %d %s: %s", e.StatusCode, e.Code, e.Message)
	}
	return fmt.Sprintf("kvgate: %d: %s", e.StatusCode, e.Message)
}

// RateLimitError is a 429. Code tells capacity_exceeded (the fleet is full, or with Scope
// "key" the key's own queue holds its cap of requests) from
// rate_limit_exceeded (the key's quota, for now), rate_limit_exceeded_queued_tokens (the
// key's cap on queued tokens) and insufficient_quota (a quota that never refills, spent: not
// worth a retry). errors.As finds it, and its APIError, in any error the Client returns.
type RateLimitError struct {
	APIError
	// BackpressureLevel is the pool's zone from X-RateLimit-Backpressure-Level ("GREEN",
	// "YELLOW", "RED", or "UNKNOWN" when the gateway could not read it, as when a queued
	// request's deadline passes while its Redis is unreachable), "" when absent.
	BackpressureLevel string
	// QueueDepth is X-Queue-Depth, the tasks queued at the request's tier or above; -1 when
	// absent or malformed.
	QueueDepth int
	// Scope is X-RateLimit-Scope, the limit that refused the request: "key" for the API
	// key's own limits (its quota, its caps on queued requests and queued tokens), else
	// "team:<name>" for the enclosing quota level whose quota is spent; "" when absent (a
	// refusal for the pool's capacity).
	Scope string
}

// Unwrap returns the embedded APIError, so that errors.As(err, &apiErr) also matches a 429.
func (e *RateLimitError) Unwrap() error { return &e.APIError }

// ConnectionError means the server could not be reached, or a stream broke, after the retries
// the policy allowed. Err is the transport's error.
type ConnectionError struct {
	// Err is the transport's (or the body reader's) error.
	Err error
}

// Error describes the error with the transport's.
func (e *ConnectionError) Error() string { return "kvgate: connection error: " + e.Err.Error() }

// Unwrap returns the transport's error.
func (e *ConnectionError) Unwrap() error { return e.Err }

// ErrIncompleteStream is the error a stream's Recv returns, inside a *ConnectionError, when
// its body ends cleanly before the data: [DONE] event: the answer was cut short (a proxy's or
// load balancer's limit, a gateway stopping), not finished. Like a connection that breaks
// mid-stream it is never retried: the events before it have been delivered.
var ErrIncompleteStream = errors.New("kvgate: the stream ended without [DONE]")

// InvalidResponseError is a success status whose body is not what the API answers with: a
// proxy's or portal's page, a body cut short, JSON that is not an object (null included), or,
// for a stream, a body that is no event stream (its Content-Type is not text/event-stream: a
// page, or a server that ignored "stream").
type InvalidResponseError struct {
	// StatusCode is the response's HTTP status.
	StatusCode int
	// Header holds the response's headers.
	Header http.Header
	// Body holds the body, or the first 64 KiB of it.
	Body []byte
	// RequestID is the response's X-Request-Id, "" when absent.
	RequestID string
	// Expected says what the body should have been: "the expected JSON", or "an event
	// stream" with the Content-Type the response had instead.
	Expected string
	// Err is the decoder's error; nil when the body was not decoded, or decoded as null.
	Err error
}

// Error describes the response: status, what it is not, and its decoder's error or the start
// of its body.
func (e *InvalidResponseError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("kvgate: %d: the response is not %s: %v", e.StatusCode, e.Expected, e.Err)
	}
	prefix := e.Body
	if len(prefix) > 200 {
		prefix = prefix[:200]
	}
	return fmt.Sprintf("kvgate: %d: the response is not %s: %q", e.StatusCode, e.Expected, prefix)
}

// Unwrap returns the decoder's error.
func (e *InvalidResponseError) Unwrap() error { return e.Err }

// StreamError is an error the server reported inside an already started stream (an event
// whose payload has an "error" member other than null, or is not a JSON object; OpenAI-
// compatible servers may send "error": null in every chunk). It is never retried: part
// of the answer has been delivered. The gateway ends a stream whose node broke off with Code
// "upstream_broken_stream".
type StreamError struct {
	// Payload is the "error" member, or the whole event when it is not an object.
	Payload json.RawMessage
	// Code is the error's machine-readable code ("" when the payload has none).
	Code string
	// Type is OpenAI's error type, e.g. "server_error".
	Type string
	// Param names the offending request field, when the server says.
	Param string
	// Message is the server's message ("" when the payload has none).
	Message string
	// RequestID is the stream's X-Request-Id, the task's name in the gateway's logs.
	RequestID string
}

// Error describes the error with its request id and payload.
func (e *StreamError) Error() string {
	if e.RequestID != "" {
		return "kvgate: error in stream (request " + e.RequestID + "): " + string(e.Payload)
	}
	return "kvgate: error in stream: " + string(e.Payload)
}

// errorFields is the OpenAI error object: {"message", "type", "param", "code"}.
type errorFields struct {
	Message      *string         `json:"message"`
	Type         *string         `json:"type"`
	Param        *string         `json:"param"`
	Code         json.RawMessage `json:"code"`
	RetryAfterMs *float64        `json:"retry_after_ms"`
}

func newStreamError(payload json.RawMessage, h http.Header) *StreamError {
	e := &StreamError{Payload: payload, RequestID: requestID(h)}
	var f errorFields
	if json.Unmarshal(payload, &f) == nil {
		e.Code, e.Type, e.Param, e.Message = rawString(f.Code), deref(f.Type), deref(f.Param), deref(f.Message)
	}
	return e
}

// requestID is the X-Request-Id of h, "" when absent.
func requestID(h http.Header) string {
	v, _ := headerValue(h, HeaderRequestID)
	return strings.TrimSpace(v)
}

type errorBody struct {
	Error *errorFields `json:"error"`
}

// decodeError reads (a bounded part of) resp's body, closes it, and returns the typed error.
func decodeError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	_ = resp.Body.Close()
	return newAPIError(resp.StatusCode, resp.Header, body, time.Now())
}

func newAPIError(status int, h http.Header, body []byte, now time.Time) error {
	e := APIError{StatusCode: status, Header: h, Body: body, Message: fmt.Sprintf("HTTP %d", status),
		RequestID: requestID(h)}
	var parsed errorBody
	if json.Unmarshal(body, &parsed) == nil && parsed.Error != nil {
		pe := parsed.Error
		if pe.Message != nil {
			e.Message = *pe.Message
		}
		e.Type = deref(pe.Type)
		e.Param = deref(pe.Param)
		e.Code = rawString(pe.Code)
		if pe.RetryAfterMs != nil && *pe.RetryAfterMs > 0 {
			e.RetryAfter = fromFloat(*pe.RetryAfterMs * float64(time.Millisecond))
		}
	}
	if d, ok := ParseRetryAfter(h, now); ok {
		e.RetryAfter = d
	}
	if location, ok := headerValue(h, "Location"); ok && status >= 300 && status < 400 {
		// A POST cannot follow a redirect as it was sent (301 and 302 turn it into a GET):
		// the fix is the client's base URL, so the message says where to point it.
		e.Message = "redirected to " + location + " (redirects are not followed: point the client at the new address)"
	}
	if status != http.StatusTooManyRequests {
		return &e
	}
	rl := &RateLimitError{APIError: e, QueueDepth: -1}
	if v, ok := headerValue(h, HeaderBackpressureLevel); ok {
		rl.BackpressureLevel = strings.TrimSpace(v)
	}
	if v, ok := headerValue(h, HeaderScope); ok {
		rl.Scope = strings.TrimSpace(v)
	}
	if v, ok := headerValue(h, HeaderQueueDepth); ok {
		if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && n >= 0 {
			rl.QueueDepth = n
		}
	}
	return rl
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// rawString turns a JSON string or number into its text; null and other types give "".
func rawString(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var n json.Number
	if json.Unmarshal(raw, &n) == nil {
		return n.String()
	}
	return ""
}

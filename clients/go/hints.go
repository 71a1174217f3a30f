package kvgate

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Headers of kvgate's 429 protocol and of the retry loop.
const (
	// HeaderRetryAfterMs is the precise hint in milliseconds; read first, as the official
	// OpenAI SDKs do.
	HeaderRetryAfterMs = "retry-after-ms"
	// HeaderRetryAfter is RFC 9110's hint: seconds, or an HTTP date.
	HeaderRetryAfter = "Retry-After"
	// HeaderShouldRetry is the server's explicit verdict, "true" or "false"; it beats the
	// status table both ways.
	HeaderShouldRetry = "x-should-retry"
	// HeaderBackpressureLevel is the pool's load zone (GREEN, YELLOW, RED) on a 429.
	HeaderBackpressureLevel = "X-RateLimit-Backpressure-Level"
	// HeaderQueueDepth is the number of tasks queued at the request's tier or above.
	HeaderQueueDepth = "X-Queue-Depth"
	// HeaderScope names the limit that refused a 429 ("key", or an enclosing quota level);
	// read into RateLimitError.Scope.
	HeaderScope = "X-RateLimit-Scope"
	// HeaderRequestID names a request's task in the gateway's logs; read into
	// APIError.RequestID and StreamError.RequestID.
	HeaderRequestID = "X-Request-Id"
	// HeaderRetryCount is sent on every retry (1 on the first retry) so that access logs,
	// proxies and the node (the gateway forwards it unread) can tell retries from first
	// attempts.
	HeaderRetryCount = "x-kvgate-retry-count"
	// HeaderReadTimeout is sent on every attempt by Transport: the seconds the client will
	// wait for its answer, as the OpenAI SDKs declare their read timeout. The gateway ends the
	// request's wait in its queue, with a 429 and its retry hint, early enough for that answer
	// to reach the client, leaving a non-streamed answer the time to generate (see Transport).
	HeaderReadTimeout = "X-Stainless-Read-Timeout"
	// HeaderRequestTimeout is the gateway's header for the longest wait in its queue alone,
	// in seconds, after which it answers the request with a 429 and its retry hint. Transport
	// does not send it; a caller may.
	HeaderRequestTimeout = "X-Request-Timeout"
)

// Forever is the hint of a header that parses to +Inf or overflows a Duration. It is not an
// endless wait: it exceeds every Policy.MaxRetryAfter, so the request gives up at once.
const Forever = time.Duration(math.MaxInt64)

// ShouldRetry is the server's x-should-retry verdict.
type ShouldRetry int

const (
	// ServerSilent: no x-should-retry header, or a value other than true or false.
	ServerSilent ShouldRetry = iota
	// ServerSaysRetry: x-should-retry: true (retry even a status outside the table).
	ServerSaysRetry
	// ServerSaysNo: x-should-retry: false (never retry this response).
	ServerSaysNo
)

// Hints is what a response says about retrying it.
type Hints struct {
	// RetryAfter is the wait the server asks for; meaningful when HasRetryAfter.
	RetryAfter time.Duration
	// HasRetryAfter is false when no hint header is present or none parses.
	HasRetryAfter bool
	// ShouldRetry is the server's explicit verdict.
	ShouldRetry ShouldRetry
}

// ParseRetryAfter returns the wait the headers ask for. Precedence follows the official
// OpenAI SDKs: retry-after-ms first (the precise value kvgate's gateway computes), then
// Retry-After as seconds (fractions allowed), then Retry-After as an HTTP date, measured from
// now (a date in the past means 0). Negative, NaN and malformed values are ignored (a bad
// retry-after-ms falls back to Retry-After); +Inf and values too large for a Duration give
// Forever. Lookups are case-insensitive for canonical http.Header maps.
func ParseRetryAfter(h http.Header, now time.Time) (time.Duration, bool) {
	if raw, ok := headerValue(h, HeaderRetryAfterMs); ok {
		if ms, ok := parseNumber(raw); ok {
			return fromFloat(ms * float64(time.Millisecond)), true
		}
	}
	raw, ok := headerValue(h, HeaderRetryAfter)
	if !ok {
		return 0, false
	}
	if s, ok := parseNumber(raw); ok {
		return fromFloat(s * float64(time.Second)), true
	}
	when, err := parseHTTPDate(strings.TrimSpace(raw))
	if err != nil {
		return 0, false
	}
	if d := when.Sub(now); d > 0 {
		return d, true
	}
	return 0, true
}

// ParseShouldRetry reads x-should-retry: "true" or "false", any case, spaces trimmed.
func ParseShouldRetry(h http.Header) ShouldRetry {
	raw, ok := headerValue(h, HeaderShouldRetry)
	if !ok {
		return ServerSilent
	}
	switch strings.ToLower(strings.TrimSpace(raw)) {
	case "true":
		return ServerSaysRetry
	case "false":
		return ServerSaysNo
	}
	return ServerSilent
}

// ParseHints reads both hints of a response; now is the wall clock for an HTTP date.
func ParseHints(h http.Header, now time.Time) Hints {
	d, ok := ParseRetryAfter(h, now)
	return Hints{RetryAfter: d, HasRetryAfter: ok, ShouldRetry: ParseShouldRetry(h)}
}

// headerValue looks a name up canonically first, then case-insensitively, so a header map
// built by hand with lower-case keys works too.
func headerValue(h http.Header, name string) (string, bool) {
	if v, ok := h[http.CanonicalHeaderKey(name)]; ok && len(v) > 0 {
		return v[0], true
	}
	for key, v := range h {
		if strings.EqualFold(key, name) && len(v) > 0 {
			return v[0], true
		}
	}
	return "", false
}

// parseNumber accepts what an ASCII decimal float literal or "inf" spells, as the Python SDK
// does: hexadecimal floats and digit underscores, which strconv also accepts, are refused.
func parseNumber(raw string) (float64, bool) {
	s := strings.TrimSpace(raw)
	if s == "" || strings.ContainsAny(s, "xX_") {
		return 0, false
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil && !isRangeError(err) {
		return 0, false
	}
	if math.IsNaN(v) || v < 0 {
		return 0, false
	}
	return v, true
}

func isRangeError(err error) bool {
	ne, ok := err.(*strconv.NumError)
	return ok && ne.Err == strconv.ErrRange
}

func fromFloat(ns float64) time.Duration {
	if ns >= math.MaxInt64 {
		return Forever
	}
	return time.Duration(math.Round(ns))
}

// parseHTTPDate accepts the three formats of RFC 9110 (http.ParseTime) and, leniently, a
// numeric zone instead of GMT.
func parseHTTPDate(s string) (time.Time, error) {
	t, err := http.ParseTime(s)
	if err == nil {
		return t, nil
	}
	if t2, err2 := time.Parse(time.RFC1123Z, s); err2 == nil {
		return t2, nil
	}
	return t, err
}

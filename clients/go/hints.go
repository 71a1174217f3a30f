package kvgate

import (
	"math"
	"net/http"
	"regexp"
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
// Retry-After as seconds (fractions allowed), then Retry-After as an HTTP date in one of RFC
// 9110's three formats (see parseHTTPDate), measured from now (a date in the past means 0).
// Negative, NaN and malformed values are ignored (a bad retry-after-ms falls back to
// Retry-After); +Inf and values too large for a Duration give Forever. Lookups are
// case-insensitive for canonical http.Header maps.
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
	when, ok := parseHTTPDate(raw, now)
	if !ok {
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

// The formats of RFC 9110's HTTP-date (section 5.6.7), case-sensitive as its grammar is: the
// IMF-fixdate senders use, and the obsolete RFC 850 and asctime dates a recipient must still
// accept. The Python SDK matches the same patterns (kvgate_client/hints.py).
const (
	httpDay     = `(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)`
	httpDayLong = `(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)`
	httpMonth   = `(?P<month>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)`
	httpTime    = `(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})`
)

var httpDateFormats = []*regexp.Regexp{
	regexp.MustCompile(`^` + httpDay + `, (?P<day>[0-9]{2}) ` + httpMonth + ` (?P<year>[0-9]{4}) ` + httpTime + ` GMT$`),
	regexp.MustCompile(`^` + httpDayLong + `, (?P<day>[0-9]{2})-` + httpMonth + `-(?P<yy>[0-9]{2}) ` + httpTime + ` GMT$`),
	regexp.MustCompile(`^` + httpDay + ` ` + httpMonth + ` (?P<day>[0-9]{2}| [0-9]) ` + httpTime + ` (?P<year>[0-9]{4})$`),
}

const httpMonths = "JanFebMarAprMayJunJulAugSepOctNovDec"

// parseHTTPDate reads an HTTP date in one of RFC 9110's formats and nothing else: no date
// without its weekday, no zone but GMT (none in asctime), no two-digit year but RFC 850's;
// http.ParseTime and time.Parse would also take one-digit hours, fractions of a second and
// names in any case, which the Python SDK refuses. The weekday is not checked against the
// date (neither SDK does). An RFC 850 year is the year ending in its two digits that is at
// most 50 years after now's and less than 50 before it, since RFC 9110 reads a date more than
// 50 years ahead as one in the past. The seconds may be 60, a leap second: the next minute's
// first.
func parseHTTPDate(raw string, now time.Time) (time.Time, bool) {
	s := strings.Trim(raw, " \t") // the OWS around a field value
	for _, re := range httpDateFormats {
		m := re.FindStringSubmatch(s)
		if m == nil {
			continue
		}
		field := func(name string) int {
			n, _ := strconv.Atoi(strings.TrimLeft(m[re.SubexpIndex(name)], " "))
			return n
		}
		month := strings.Index(httpMonths, m[re.SubexpIndex("month")])/3 + 1
		var year int
		if re.SubexpIndex("yy") >= 0 {
			current := now.UTC().Year()
			year = current + ((field("yy")-current)%100+100)%100
			if year > current+50 {
				year -= 100
			}
		} else {
			year = field("year")
		}
		day, hour, minute, second := field("day"), field("hour"), field("minute"), field("second")
		if day < 1 || day > daysIn(year, month) || hour > 23 || minute > 59 || second > 60 {
			return time.Time{}, false
		}
		return time.Date(year, time.Month(month), day, hour, minute, second, 0, time.UTC), true
	}
	return time.Time{}, false
}

// daysIn is the number of days of a month in the proleptic Gregorian calendar.
func daysIn(year, month int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

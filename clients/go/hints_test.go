package kvgate

import (
	"net/http"
	"testing"
	"time"
)

var hintNow = time.Unix(1_700_000_000, 0)

func TestRetryAfterValues(t *testing.T) {
	cases := []struct {
		headers map[string]string
		want    time.Duration
		ok      bool
	}{
		{map[string]string{"retry-after-ms": "3500", "retry-after": "3"}, 3500 * time.Millisecond, true},
		{map[string]string{"Retry-After": "3"}, 3 * time.Second, true},
		{map[string]string{"retry-after": "0.25"}, 250 * time.Millisecond, true},
		{map[string]string{"retry-after": " 2 "}, 2 * time.Second, true},
		{map[string]string{"retry-after-ms": "garbage", "retry-after": "2"}, 2 * time.Second, true},
		{map[string]string{"retry-after-ms": "-5"}, 0, false},
		{map[string]string{"retry-after": "soon"}, 0, false},
		{map[string]string{"retry-after": "nan"}, 0, false},
		{map[string]string{"retry-after": "0x10"}, 0, false}, // strconv would read 16; Python refuses
		{map[string]string{"retry-after-ms": "inf"}, Forever, true},
		{map[string]string{"retry-after": "1e300"}, Forever, true},
		{map[string]string{}, 0, false},
	}
	for _, c := range cases {
		h := http.Header{}
		for k, v := range c.headers {
			h.Set(k, v)
		}
		got, ok := ParseRetryAfter(h, hintNow)
		if got != c.want || ok != c.ok {
			t.Errorf("%v: got %v %v, want %v %v", c.headers, got, ok, c.want, c.ok)
		}
	}
}

func TestRetryAfterHTTPDate(t *testing.T) {
	h := http.Header{"Retry-After": {hintNow.Add(42 * time.Second).UTC().Format(http.TimeFormat)}}
	if got, ok := ParseRetryAfter(h, hintNow); !ok || got != 42*time.Second {
		t.Fatal(got, ok)
	}
	h.Set("Retry-After", hintNow.Add(-42*time.Second).UTC().Format(http.TimeFormat))
	if got, ok := ParseRetryAfter(h, hintNow); !ok || got != 0 {
		t.Fatal(got, ok)
	}
	// RFC 9110's obsolete formats, which http.ParseTime also reads; the vectors hold the
	// forms it reads that the grammar does not.
	for _, layout := range []string{"Monday, 02-Jan-06 15:04:05 GMT", time.ANSIC} {
		h.Set("Retry-After", hintNow.Add(5*time.Second).UTC().Format(layout))
		if got, ok := ParseRetryAfter(h, hintNow); !ok || got != 5*time.Second {
			t.Fatal(h.Get("Retry-After"), got, ok)
		}
	}
	// The grammar's zone is GMT alone: Go's own layouts with a numeric zone are no HTTP date.
	h.Set("Retry-After", hintNow.Add(5*time.Second).Format(time.RFC1123Z))
	if got, ok := ParseRetryAfter(h, hintNow); ok {
		t.Fatal("a numeric zone", got, ok)
	}
}

func TestHintsOnAHandBuiltMapAnyCase(t *testing.T) {
	h := http.Header{"retry-after-ms": {"1200"}, "X-SHOULD-RETRY": {"FALSE"}}
	hints := ParseHints(h, hintNow)
	if !hints.HasRetryAfter || hints.RetryAfter != 1200*time.Millisecond || hints.ShouldRetry != ServerSaysNo {
		t.Fatalf("%+v", hints)
	}
}

func TestShouldRetry(t *testing.T) {
	for value, want := range map[string]ShouldRetry{
		"true": ServerSaysRetry, "false": ServerSaysNo, " False ": ServerSaysNo, "maybe": ServerSilent,
	} {
		if got := ParseShouldRetry(http.Header{"X-Should-Retry": {value}}); got != want {
			t.Errorf("%q: %v, want %v", value, got, want)
		}
	}
	if got := ParseShouldRetry(http.Header{"Retry-After": {"1"}}); got != ServerSilent {
		t.Fatal(got)
	}
}

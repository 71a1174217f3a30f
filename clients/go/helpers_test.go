package kvgate

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// fakeClock moves only when slept on; it starts at the real time so that context deadlines,
// which are wall-clock times, compare with it sensibly.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	sleeps []time.Duration
	// onSleep, when set, runs in place of the time passing (e.g. the server recovering).
	onSleep func(d time.Duration)
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Now()} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	c.sleeps = append(c.sleeps, d)
	c.now = c.now.Add(d)
	hook := c.onSleep
	c.mu.Unlock()
	if hook != nil {
		hook(d)
	}
	return ctx.Err()
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func (c *fakeClock) slept() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.sleeps...)
}

func constRand(u float64) func() float64 { return func() float64 { return u } }

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func mustRetrier(t interface{ Fatal(...interface{}) }, o RetrierOptions) *Retrier {
	r, err := NewRetrier(o)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// budgetedRetrier is a retrier on a fake clock, with no jitter, whose budget starts full at
// tokens tokens.
func budgetedRetrier(t interface{ Fatal(...interface{}) }, tokens float64) (*Retrier, *Budget) {
	opts := DefaultBudgetOptions()
	opts.MaxTokens, opts.InitialTokens = tokens, tokens
	budget, err := NewBudget(opts)
	if err != nil {
		t.Fatal(err)
	}
	return mustRetrier(t, RetrierOptions{Budget: budget, Clock: newFakeClock(), Rand: constRand(0)}), budget
}

// roundTripFunc is an in-memory http.RoundTripper for tests that need no socket.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	return f(req)
}

func stubResponse(req *http.Request, status int, h http.Header) *http.Response {
	if h == nil {
		h = http.Header{}
	}
	return &http.Response{StatusCode: status, Header: h, Body: io.NopCloser(strings.NewReader("{}")),
		Request: req, ProtoMajor: 1, ProtoMinor: 1}
}

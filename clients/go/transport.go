package kvgate

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// discardLimit bounds what is read from a response about to be retried, so that its
// connection can go back to the pool; a longer body is cut off with its connection.
const discardLimit = 64 << 10

// Transport is an http.RoundTripper that applies a Retrier's policy below any *http.Client.
//
// A retry happens only before a response is returned: once RoundTrip has handed a response
// to its caller, its body, streamed or not, belongs to the caller and is never read, buffered
// or replayed here, and an error while the caller reads it is never retried. Responses to be
// retried are read (at most 64 KiB) and closed before the backoff sleep.
//
// A request is retried only if its body can be sent again: no body, http.NoBody, or a
// GetBody function (http.NewRequest sets one for *bytes.Buffer, *bytes.Reader and
// *strings.Reader bodies). Other requests are sent once. Retries are clones of the request
// carrying an x-kvgate-retry-count header; the caller's request is never modified.
//
// The request's context bounds everything: its deadline caps the retry loop (see
// Retrier.Begin) and its cancellation interrupts a backoff sleep, which then returns the
// context's error.
type Transport struct {
	base    http.RoundTripper
	retrier *Retrier
}

// NewTransport wraps base (http.DefaultTransport when nil) with retrier's policy (a
// NewDefaultRetrier() when nil). Requests through one Transport share its retrier's budget
// and counters.
func NewTransport(base http.RoundTripper, retrier *Retrier) *Transport {
	if base == nil {
		base = http.DefaultTransport
	}
	if retrier == nil {
		retrier = NewDefaultRetrier()
	}
	return &Transport{base: base, retrier: retrier}
}

// NewHTTPClient returns an *http.Client whose transport is NewTransport(base, retrier), with
// no overall timeout (a stream may last minutes; bound requests with their context). It is
// what to hand to any client library that accepts an *http.Client.
func NewHTTPClient(base http.RoundTripper, retrier *Retrier) *http.Client {
	return &http.Client{Transport: NewTransport(base, retrier)}
}

// Retrier returns the transport's retrier.
func (t *Transport) Retrier() *Retrier { return t.retrier }

// Base returns the wrapped transport.
func (t *Transport) Base() http.RoundTripper { return t.base }

// Stats returns the retrier's counters.
func (t *Transport) Stats() Stats { return t.retrier.Stats() }

// CloseIdleConnections closes the base transport's idle connections, when it has any.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// RoundTrip sends req, and again as the policy decides; see Transport.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	replayable := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
	state := t.retrier.Begin(ctx)
	attempt := req
	for {
		resp, err := t.base.RoundTrip(attempt)
		var d Decision
		switch {
		case err != nil && (ctx.Err() != nil || !IsConnectionError(err)):
			state.AfterError(err, false)
			return nil, err
		case err != nil && !replayable:
			state.Stop(OutcomeNotReplayable)
			return nil, err
		case err != nil:
			if d = state.AfterError(err, true); !d.Retry {
				return nil, err
			}
		case !replayable:
			state.afterUnreplayable(resp.StatusCode, resp.Header)
			return resp, nil
		default:
			if d = state.AfterResponse(resp.StatusCode, resp.Header); !d.Retry {
				return resp, nil
			}
			discard(resp)
		}
		if err := t.retrier.clock.Sleep(ctx, d.Delay); err != nil {
			state.Stop(OutcomeCanceled)
			return nil, err
		}
		next, err := retryRequest(ctx, req, state.Attempts())
		if err != nil {
			state.Stop(OutcomeError)
			return nil, err
		}
		state.StartRetry()
		attempt = next
	}
}

// retryRequest clones req with a fresh body and the retry-count header (retry: the attempts
// sent before it).
func retryRequest(ctx context.Context, req *http.Request, retry int) (*http.Request, error) {
	next := req.Clone(ctx)
	if req.GetBody != nil {
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		next.Body = body
	}
	next.Header.Set(HeaderRetryCount, strconv.Itoa(retry))
	return next, nil
}

func discard(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, discardLimit))
	_ = resp.Body.Close()
}

// IsConnectionError reports whether err means the request either never reached the server or
// the connection died before a status line came back: a failed dial (refused, unreachable,
// name resolution, connect timeout), a reset or broken connection, or an EOF before the
// response. Timeouts after the connection was made (a read or response-header timeout) and
// canceled contexts are not: the request may be running on a GPU, and a second copy doubles
// the load exactly when the fleet is slow.
func IsConnectionError(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var op *net.OpError
	// Before the deadline check: a dial that hits the Dialer's timeout is an OpError whose
	// error also reads as context.DeadlineExceeded. (A request whose own context expired is
	// not retried either way: RoundTrip checks the context first.)
	if errors.As(err, &op) && (op.Op == "dial" || op.Op == "proxyconnect") {
		return true
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if errors.As(err, &op) {
		return !op.Timeout()
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		// http.Transport's TLS handshake timeout (an unexported type): the connection was
		// never usable, so no request reached the server.
		return strings.Contains(err.Error(), "TLS handshake timeout")
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.EPIPE)
}

// DefaultBase returns a new transport as NewClient puts below its retries when
// ClientOptions.Base is nil: http.DefaultTransport's settings with more idle connections per
// host (a client talks to one gateway) and the Python SDK's timeouts: 5 s to connect, 600 s
// for the response headers. Wrap it to observe attempts without losing those settings.
func DefaultBase() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.MaxIdleConns = 1000
	t.MaxIdleConnsPerHost = 100
	t.ResponseHeaderTimeout = 600 * time.Second
	return t
}

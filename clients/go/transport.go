package kvgate

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
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
//
// Every attempt tells the gateway how long the client will wait for its answer, in the header
// in which the OpenAI SDKs declare their read timeout (X-Stainless-Read-Timeout, seconds): the
// sooner of the context's deadline and the base's ResponseHeaderTimeout (when the base is an
// *http.Transport itself, not a wrapper around one). The gateway ends the request's wait in
// its queue early enough for its 429 and retry hint to reach the client in that time, and,
// the first byte of a non-streamed answer being all of it, earlier still by the time the
// answer may take to generate. A request still queued at the gateway then gets its 429 while
// the client listens, instead of the client's timer firing first with no hint, and a request
// released from the queue has the time to generate its answer. The wait is computed again for
// each attempt, from the time left; a request that carries the header already keeps its own
// value, and one with neither a deadline nor such a timeout sends none.
type Transport struct {
	base    http.RoundTripper
	retrier *Retrier
}

// NewTransport wraps base (a new DefaultBase() when nil, as NewClient uses) with retrier's
// policy (a NewDefaultRetrier() when nil). Requests through one Transport share its
// retrier's budget and counters.
func NewTransport(base http.RoundTripper, retrier *Retrier) *Transport {
	if base == nil {
		base = DefaultBase()
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
	_, declared := headerValue(req.Header, HeaderReadTimeout)
	attempt := req
	for {
		if !declared {
			attempt = t.declareTimeout(ctx, req, attempt)
		}
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

// declareTimeout returns attempt carrying X-Stainless-Read-Timeout for the time the client has
// left, cloned first if it is the caller's request; attempt itself when no wait is bounded.
func (t *Transport) declareTimeout(ctx context.Context, req, attempt *http.Request) *http.Request {
	wait, ok := time.Duration(0), false
	if deadline, has := ctx.Deadline(); has {
		wait, ok = deadline.Sub(t.retrier.clock.Now()), true
	}
	if ht, isHT := t.base.(*http.Transport); isHT && ht.ResponseHeaderTimeout > 0 && (!ok || ht.ResponseHeaderTimeout < wait) {
		wait, ok = ht.ResponseHeaderTimeout, true
	}
	if !ok || wait <= 0 {
		return attempt // the context's own error ends the attempt
	}
	if attempt == req {
		attempt = req.Clone(ctx)
	}
	attempt.Header.Set(HeaderReadTimeout, readTimeout(wait))
	return attempt
}

// readTimeout is the X-Stainless-Read-Timeout value for a client that waits wait for an
// answer: the seconds, to the millisecond, rounded down; at least 1 ms. The Python SDK sends
// the same value for the same wait (clients/vectors/retry_policy.json).
func readTimeout(wait time.Duration) string {
	ms := wait.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return fmt.Sprintf("%d.%03d", ms/1000, ms%1000)
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
// name resolution, connect timeout; to the proxy too), a reset or broken connection, a kept-
// alive connection the server closed as the request went out, or an EOF before the response.
// Timeouts after the connection was made (a read or response-header timeout) and canceled
// contexts are not: the request may be running on a GPU, and a second copy doubles the load
// exactly when the fleet is slow. Nor is a reply that breaks HTTP (a malformed status line or
// header): a reply came, so the request may have run. Nor are failures that repeat on every
// attempt: a server's (or an https proxy's) certificate that fails verification, and a proxy
// that refuses the tunnel (its CONNECT answered 407, 403, 502). The Python SDK draws the same
// lines.
func IsConnectionError(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || isCertificateError(err) {
		return false
	}
	// net/http's errServerClosedIdle, unexported: a POST (not idempotent) sent on a kept-alive
	// connection the server closed, as idle, at that moment. The server read none of it.
	if strings.Contains(err.Error(), "http: server closed idle connection") {
		return true
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

// isCertificateError: the peer's certificate failed verification (Go 1.20 and later wrap
// these in a tls.CertificateVerificationError, which errors.As looks through).
func isCertificateError(err error) bool {
	var unknown x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var roots x509.SystemRootsError
	return errors.As(err, &unknown) || errors.As(err, &hostname) || errors.As(err, &invalid) ||
		errors.As(err, &roots)
}

// DefaultBase returns a new transport as NewClient and NewTransport put below their retries
// when given no base: http.DefaultTransport's settings with more idle connections per host (a
// client talks to one gateway), idle connections closed after 30 s, and the Python SDK's
// timeouts: 5 s to connect, 600 s for the response headers. A wrapper around it (to observe
// attempts, say) keeps those settings, but Transport reads ResponseHeaderTimeout only from a
// base that is an *http.Transport itself: below a wrapper, the wait each attempt declares to
// the gateway comes from the request context's deadline alone, and a request without one
// declares none (its tier's queue timeout applies).
//
// The idle timeout is below the gateway's keep-alive (gateway.keepalive_timeout_ms, 75 s by
// default): a connection the client closes first is never one the gateway is closing while a
// request goes out on it (http.DefaultTransport keeps them 90 s).
func DefaultBase() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.MaxIdleConns = 1000
	t.MaxIdleConnsPerHost = 100
	t.IdleConnTimeout = DefaultIdleConnTimeout
	t.ResponseHeaderTimeout = 600 * time.Second
	return t
}

// DefaultIdleConnTimeout is DefaultBase's IdleConnTimeout: below the gateway's 75 s keep-alive.
const DefaultIdleConnTimeout = 30 * time.Second

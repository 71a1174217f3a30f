// The Transport and the network: which failures to connect are retried (a connection closed
// before any reply, a refused or timed-out dial, a kept-alive connection the server closed as
// idle, a proxy that cannot be reached) and which are not (a reply that breaks HTTP, a response
// timeout, a certificate that fails verification, a proxy that refuses the tunnel), and the
// base transport's defaults (DefaultBase, its idle connections closed before the gateway's
// keep-alive ends).

package kvgate

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestConnectionErrorsAreRetried(t *testing.T) {
	srv := newCounted(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if n <= 2 { // the connection dies before a status line
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		fmt.Fprint(w, "ok")
	})
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, srv.URL, "{}")
	resp.Body.Close()
	if resp.StatusCode != 200 || srv.calls() != 3 || len(clock.slept()) != 2 {
		t.Fatal(resp.StatusCode, srv.calls(), clock.slept())
	}
}

// rawServer answers the n-th connection with replies[n] (the last one after them) once it has
// read the request, then closes it; it returns its URL and the replies sent so far.
func rawServer(t *testing.T, replies ...string) (string, func() []string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var sent []string
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			i := len(sent)
			if i >= len(replies) {
				i = len(replies) - 1
			}
			reply := replies[i]
			sent = append(sent, reply)
			mu.Unlock()
			if req, err := http.ReadRequest(bufio.NewReader(conn)); err == nil {
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(conn, reply)
			}
			conn.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return "http://" + ln.Addr().String(), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), sent...)
	}
}

const okReply = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"

// A server that read the request and closed before any status line (net/http's EOF; httpx's
// "Server disconnected without sending a response") is retried; one whose reply breaks HTTP
// is not: a reply came, so the request may have run. The Python SDK draws the same lines.
func TestOnlyAConnectionClosedWithoutAReplyIsRetried(t *testing.T) {
	url, sent := rawServer(t, "", "", okReply)
	clock := newFakeClock()
	tr := newTestTransport(t, clock, nil, nil)
	resp := post(t, tr, url, "{}")
	resp.Body.Close()
	if resp.StatusCode != 200 || len(sent()) != 3 || len(clock.slept()) != 2 {
		t.Fatal(resp.StatusCode, sent(), clock.slept())
	}
	for _, reply := range []string{
		"HTTP/1.1 abc Weird\r\nfoo\r\n\r\n", // a status code that is no number
		"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
	} {
		url, sent := rawServer(t, reply, okReply)
		tr := newTestTransport(t, newFakeClock(), nil, nil)
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) {
			t.Fatalf("%q: %v", reply, err)
		}
		if st := tr.Stats(); st.Attempts != 1 || st.Outcomes[OutcomeError] != 1 || len(sent()) != 1 {
			t.Fatalf("%q: %+v %q", reply, st, sent())
		}
	}
}

func TestRefusedConnectionsExhaustedReturnTheLastError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there any more: every dial is refused
	tr := newTestTransport(t, newFakeClock(), nil, nil)
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
	if _, err := tr.RoundTrip(req); !IsConnectionError(err) {
		t.Fatal(err)
	}
	if st := tr.Stats(); st.Attempts != 3 || st.Outcomes[OutcomeMaxAttempts] != 1 {
		t.Fatalf("%+v", st)
	}
}

// A dial that times out (a replica gone, its address dropping SYNs) never reached a server:
// it is retried like a refused one. Go reports it as an OpError that also reads as
// context.DeadlineExceeded, which must not hide the dial.
func TestDialTimeoutsAreRetried(t *testing.T) {
	base := DefaultBase()
	base.DialContext = (&net.Dialer{Deadline: time.Now().Add(-time.Second)}).DialContext
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock(), Rand: NewRand(3)}))
	req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:9/v1/chat/completions", strings.NewReader("{}"))
	_, err := tr.RoundTrip(req)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !IsConnectionError(err) {
		t.Fatal(err)
	}
	if st := tr.Stats(); st.Attempts != 3 || st.Outcomes[OutcomeMaxAttempts] != 1 {
		t.Fatalf("%+v", st)
	}
}

func TestTimeoutsAreNotRetried(t *testing.T) {
	release := make(chan struct{})
	srv := newCounted(t, func(w http.ResponseWriter, r *http.Request, n int) {
		<-release // the request is "running on a GPU"
	})
	defer close(release)
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.ResponseHeaderTimeout = 50 * time.Millisecond
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
	_, err := tr.RoundTrip(req)
	if err == nil || IsConnectionError(err) {
		t.Fatal(err)
	}
	if srv.calls() != 1 || tr.Stats().Outcomes[OutcomeError] != 1 {
		t.Fatal(srv.calls(), tr.Stats().Outcomes)
	}
}

// NewHTTPClient(nil, nil), like NewClient, sends through DefaultBase's settings, not
// http.DefaultTransport's (2 idle connections per host, no response-header timeout).
func TestNoBaseMeansDefaultBase(t *testing.T) {
	for _, rt := range []http.RoundTripper{NewHTTPClient(nil, nil).Transport, NewTransport(nil, nil)} {
		base, ok := rt.(*Transport).Base().(*http.Transport)
		if !ok || base == http.DefaultTransport || base.MaxIdleConnsPerHost != 100 ||
			base.ResponseHeaderTimeout != 600*time.Second || base.IdleConnTimeout != DefaultIdleConnTimeout {
			t.Fatalf("%T %+v", rt.(*Transport).Base(), rt.(*Transport).Base())
		}
	}
}

// The client drops an idle connection before the gateway does (its keep-alive is 75 s by
// default), so that no request goes out on a connection the gateway is closing.
func TestIdleConnectionsCloseBeforeTheGatewaysKeepAlive(t *testing.T) {
	if idle := DefaultBase().IdleConnTimeout; idle <= 0 || idle >= 75*time.Second {
		t.Fatal(idle)
	}
}

// serverClosedIdle is net/http's errServerClosedIdle, unexported: what a POST on a kept-alive
// connection returns when the server closed it, as idle, as the request went out.
var serverClosedIdle = errors.New("http: server closed idle connection")

func TestAConnectionTheServerClosedAsIdleIsRetried(t *testing.T) {
	calls := 0
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		calls++
		if calls == 1 {
			return nil, serverClosedIdle
		}
		return stubResponse(req, 200, nil), nil
	})
	tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
	req, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil || resp.StatusCode != 200 || calls != 2 {
		t.Fatal(err, calls)
	}
	wrapped := &url.Error{Op: "Post", URL: "http://gw/v1/chat/completions", Err: serverClosedIdle}
	if !IsConnectionError(wrapped) {
		t.Fatal("a wrapped one is a connection error too")
	}
}

// A certificate that fails verification fails every attempt the same way: the server's own,
// or an https proxy's (which net/http reports as a "proxyconnect" error, like a refused dial
// to the proxy).
func TestACertificateThatFailsVerificationIsNotRetried(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "{}")
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshakes the client aborts
	srv.StartTLS()
	defer srv.Close()
	direct := DefaultBase()
	viaProxy := DefaultBase()
	viaProxy.Proxy = http.ProxyURL(mustParse(t, srv.URL))
	for name, c := range map[string]struct {
		base *http.Transport
		url  string
	}{"direct": {direct, srv.URL}, "https proxy": {viaProxy, "http://gateway.invalid/v1/chat/completions"}} {
		tr := NewTransport(c.base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
		req, _ := http.NewRequest(http.MethodPost, c.url, strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) || !isCertificateError(err) {
			t.Fatalf("%s: %v", name, err)
		}
		if st := tr.Stats(); st.Attempts != 1 || st.Outcomes[OutcomeError] != 1 {
			t.Fatalf("%s: %+v", name, st)
		}
	}
}

// A proxy that cannot be reached is a connection error (the request reached no one); one that
// refuses the tunnel answers the same on every attempt. The Python SDK draws the same lines.
func TestProxiesThatCannotBeReachedAreRetriedOnesThatRefuseAreNot(t *testing.T) {
	refusing := newCounted(t, func(w http.ResponseWriter, r *http.Request, n int) {
		w.WriteHeader(http.StatusProxyAuthRequired)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there any more: every dial is refused
	for _, c := range []struct {
		proxy     string
		attempts  int64
		retryable bool
	}{{refusing.URL, 1, false}, {gone, MaxAttempts, true}} {
		base := DefaultBase()
		base.Proxy = http.ProxyURL(mustParse(t, c.proxy))
		tr := NewTransport(base, mustRetrier(t, RetrierOptions{Clock: newFakeClock()}))
		req, _ := http.NewRequest(http.MethodPost, "https://gateway.invalid/v1/chat/completions", strings.NewReader("{}"))
		_, err := tr.RoundTrip(req)
		if err == nil || IsConnectionError(err) != c.retryable || tr.Stats().Attempts != c.attempts {
			t.Fatalf("%s: %v %+v", c.proxy, err, tr.Stats())
		}
	}
	if refusing.calls() != 1 {
		t.Fatal(refusing.calls())
	}
}

func mustParse(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

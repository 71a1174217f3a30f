package main

import (
	"net/http"
	"testing"
	"time"

	"kvgate"
)

// Traced or not, the example's requests go through a transport with NewClient's settings, not
// http.DefaultTransport's (2 idle connections per host, no response-header timeout): with
// -concurrency 20 that tore down 18 connections after every request.
func TestTheExampleKeepsTheClientsTransportSettings(t *testing.T) {
	check := func(rt http.RoundTripper) {
		t.Helper()
		tr, ok := rt.(*http.Transport)
		if !ok || tr.MaxIdleConnsPerHost != 100 || tr.ResponseHeaderTimeout != 600*time.Second {
			t.Fatalf("%T %+v", rt, rt)
		}
	}
	plain := kvgate.NewClient("http://127.0.0.1:1/v1", kvgate.ClientOptions{Base: baseFor(false, time.Now())})
	check(plain.Transport().Base())
	traced, ok := baseFor(true, time.Now()).(*tracer)
	if !ok {
		t.Fatal("no tracer with -trace")
	}
	check(traced.base)
}

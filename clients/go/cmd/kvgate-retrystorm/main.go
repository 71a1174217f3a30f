// Command kvgate-retrystorm is the Go arm of kvgate's retry-storm bench
// (bench/perf/retry_storm.py): it starts -clients clients at once, each with its own
// connection and its own kvgate.Retrier (default policy, default budget, its own seeded random
// source), each sending one chat completion to -url through kvgate.Transport, and prints how
// they ended as one JSON object:
//
//	{"clients": 1000, "succeeded": 1000, "gave_up": 0, "errors": 0, "attempts": 2000, "retries": 1000}
//
// succeeded = a 200 in the end, gave_up = an error status in the end (the policy stopped),
// errors = no status at all. The bench's server counts the arrivals itself.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"kvgate"
)

const body = `{"model": "m", "messages": [{"role": "user", "content": "hi"}]}`

func main() {
	url := flag.String("url", "", "where to POST, e.g. http://127.0.0.1:8080/v1/chat/completions")
	clients := flag.Int("clients", 1000, "clients, each with its own connection and retrier")
	seed := flag.Int64("seed", 0, "seed of the clients' random sources")
	dials := flag.Int("dial-concurrency", 64, "connections opened at once (a SYN flood of 1,000 overflows backlogs)")
	flag.Parse()
	if *url == "" {
		fmt.Fprintln(os.Stderr, "-url is required")
		os.Exit(2)
	}

	dialer := &net.Dialer{Timeout: 30 * time.Second}
	slots := make(chan struct{}, *dials)
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		slots <- struct{}{}
		defer func() { <-slots }()
		return dialer.DialContext(ctx, network, addr)
	}
	seeds := rand.New(rand.NewSource(*seed))
	transports := make([]*kvgate.Transport, *clients)
	for i := range transports {
		base := &http.Transport{DialContext: dial, MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, DisableCompression: true}
		retrier, err := kvgate.NewRetrier(kvgate.RetrierOptions{Rand: kvgate.NewRand(seeds.Int63())})
		if err != nil {
			panic(err)
		}
		transports[i] = kvgate.NewTransport(base, retrier)
	}

	var mu sync.Mutex
	out := map[string]int64{"clients": int64(*clients), "succeeded": 0, "gave_up": 0, "errors": 0, "attempts": 0, "retries": 0}
	var wg sync.WaitGroup
	for _, t := range transports {
		wg.Add(1)
		go func(t *kvgate.Transport) {
			defer wg.Done()
			outcome := send(&http.Client{Transport: t}, *url)
			stats := t.Stats()
			mu.Lock()
			out[outcome]++
			out["attempts"] += stats.Attempts
			out["retries"] += stats.Retries
			mu.Unlock()
			t.CloseIdleConnections()
		}(t)
	}
	wg.Wait()
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		panic(err)
	}
}

func send(client *http.Client, url string) string {
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return "errors"
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		return "succeeded"
	}
	return "gave_up"
}

// Command chat sends chat completions (or completions) through a kvgate gateway with the Go
// SDK's retry policy, and prints the answer; streamed answers are printed as they arrive.
//
//	go run ./examples/chat -base-url http://127.0.0.1:8080/v1 -api-key sk-demo-vip -stream
//
// With -n above 1 it sends that many requests from -concurrency goroutines sharing one client
// (so one retry budget) and prints a JSON summary instead of the answers. With -timeout each
// request's context ends after that long; the client tells the gateway (X-Stainless-Read-Timeout),
// so a request still queued then gets its 429 and retry hint before the context ends. With
// -trace it writes one JSON line per attempt to stderr (when it was sent and answered, relative
// to the start, the X-Stainless-Read-Timeout it declared, its status and the gateway's 429
// headers) and the client's retry counters at the end.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"kvgate"
)

func main() {
	baseURL := flag.String("base-url", envOr("KVGATE_BASE_URL", kvgate.DefaultBaseURL), "the gateway's API root")
	apiKey := flag.String("api-key", "", "API key (default $KVGATE_API_KEY, then $OPENAI_API_KEY)")
	model := flag.String("model", "demo", "model (the pool's name)")
	prompt := flag.String("prompt", "Say hello.", "the user message (or the prompt with -completions)")
	maxTokens := flag.Int("max-tokens", 16, "max_tokens")
	stream := flag.Bool("stream", false, "stream the answer")
	completions := flag.Bool("completions", false, "use /completions instead of /chat/completions")
	n := flag.Int("n", 1, "number of requests")
	concurrency := flag.Int("concurrency", 1, "goroutines sending them")
	budgetInitial := flag.Float64("budget-initial", kvgate.MaxTokens, "tokens in the retry budget at start (0: at most 1.1 attempts per request from the start)")
	trace := flag.Bool("trace", false, "JSON lines on stderr: every attempt, then the retry counters")
	timeout := flag.Duration("timeout", 0, "how long each request may take, retries included (0: no limit)")
	flag.Parse()

	start := time.Now()
	base := baseFor(*trace, start)
	budgetOptions := kvgate.DefaultBudgetOptions()
	budgetOptions.InitialTokens = *budgetInitial
	budget, err := kvgate.NewBudget(budgetOptions)
	if err != nil {
		fail(err)
	}
	retrier, err := kvgate.NewRetrier(kvgate.RetrierOptions{Budget: budget})
	if err != nil {
		fail(err)
	}
	client := kvgate.NewClient(*baseURL, kvgate.ClientOptions{APIKey: *apiKey, Retrier: retrier, Base: base})
	ask := request{client: client, model: *model, prompt: *prompt, maxTokens: *maxTokens, stream: *stream, completions: *completions, timeout: *timeout}

	if *n == 1 {
		if err = ask.send(context.Background(), os.Stdout); err == nil {
			fmt.Println()
		}
	} else {
		err = ask.many(*n, *concurrency)
	}
	if *trace {
		writeJSON(os.Stderr, map[string]interface{}{"event": "stats", "stats": client.Stats()})
	}
	if err != nil {
		fail(err)
	}
}

type request struct {
	client      *kvgate.Client
	model       string
	prompt      string
	maxTokens   int
	stream      bool
	completions bool
	timeout     time.Duration
}

// drain reads a stream to its end, handing each event to write as it arrives, and closes it.
func drain[T any](s *kvgate.Stream[T], write func(T)) error {
	defer s.Close()
	for {
		event, err := s.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		write(event)
	}
}

// send makes one request and writes the answer's text to out, each chunk as it arrives.
func (r request) send(ctx context.Context, out io.Writer) error {
	if r.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.timeout)
		defer cancel()
	}
	messages := []kvgate.Message{{Role: "user", Content: r.prompt}}
	switch {
	case r.completions && r.stream:
		s, err := r.client.CompletionStream(ctx, kvgate.CompletionRequest{Model: r.model, Prompt: r.prompt, MaxTokens: r.maxTokens})
		if err != nil {
			return err
		}
		return drain(s, func(c kvgate.Completion) {
			for _, choice := range c.Choices {
				fmt.Fprint(out, choice.Text)
			}
		})
	case r.stream:
		s, err := r.client.ChatCompletionStream(ctx, kvgate.ChatCompletionRequest{Model: r.model, Messages: messages, MaxTokens: r.maxTokens})
		if err != nil {
			return err
		}
		return drain(s, func(c kvgate.ChatCompletionChunk) {
			for _, choice := range c.Choices {
				fmt.Fprint(out, choice.Delta.Content)
			}
		})
	case r.completions:
		c, err := r.client.Completion(ctx, kvgate.CompletionRequest{Model: r.model, Prompt: r.prompt, MaxTokens: r.maxTokens})
		if err != nil {
			return err
		}
		for _, choice := range c.Choices {
			fmt.Fprint(out, choice.Text)
		}
	default:
		c, err := r.client.ChatCompletion(ctx, kvgate.ChatCompletionRequest{Model: r.model, Messages: messages, MaxTokens: r.maxTokens})
		if err != nil {
			return err
		}
		for _, choice := range c.Choices {
			fmt.Fprint(out, choice.Message.Content)
		}
	}
	return nil
}

// many sends n requests from concurrency goroutines and prints how they ended.
func (r request) many(n, concurrency int) error {
	var mu sync.Mutex
	summary := map[string]int{"requests": n, "ok": 0, "rate_limited": 0, "other_errors": 0}
	jobs := make(chan struct{}, n)
	for i := 0; i < n; i++ {
		jobs <- struct{}{}
	}
	close(jobs)
	var wg sync.WaitGroup
	for g := 0; g < concurrency; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				err := r.send(context.Background(), io.Discard)
				var rl *kvgate.RateLimitError
				mu.Lock()
				switch {
				case err == nil:
					summary["ok"]++
				case errors.As(err, &rl):
					summary["rate_limited"]++
				default:
					summary["other_errors"]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	writeJSON(os.Stdout, summary)
	return nil
}

// tracer records every attempt below the retries: what the gateway saw and answered.
type tracer struct {
	base  http.RoundTripper
	start time.Time
	mu    sync.Mutex
}

func (t *tracer) RoundTrip(req *http.Request) (*http.Response, error) {
	sent := time.Since(t.start).Seconds()
	resp, err := t.base.RoundTrip(req)
	line := map[string]interface{}{
		"event":        "attempt",
		"retry_count":  req.Header.Get(kvgate.HeaderRetryCount),
		"read_timeout": req.Header.Get(kvgate.HeaderReadTimeout),
		"sent_s":       sent,
		"answered_s":   time.Since(t.start).Seconds(),
	}
	if err != nil {
		line["error"] = err.Error()
	} else {
		line["status"] = resp.StatusCode
		for key, name := range map[string]string{
			"retry_after_ms": kvgate.HeaderRetryAfterMs,
			"retry_after":    kvgate.HeaderRetryAfter,
			"level":          kvgate.HeaderBackpressureLevel,
			"queue_depth":    kvgate.HeaderQueueDepth,
		} {
			if v := resp.Header.Get(name); v != "" {
				line[key] = v
			}
		}
	}
	t.mu.Lock()
	writeJSON(os.Stderr, line)
	t.mu.Unlock()
	return resp, err
}

func writeJSON(w io.Writer, v interface{}) {
	b, _ := json.Marshal(v)
	fmt.Fprintln(w, string(b))
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// fail prints err, with the 429 protocol's fields when it is a RateLimitError, and exits 1.
func fail(err error) {
	var rl *kvgate.RateLimitError
	if errors.As(err, &rl) {
		fmt.Fprintf(os.Stderr, "rate limited: code=%s retry_after_ms=%d level=%s queue_depth=%d scope=%s: %s\n",
			rl.Code, rl.RetryAfter.Milliseconds(), rl.BackpressureLevel, rl.QueueDepth, rl.Scope, rl.Message)
	} else {
		fmt.Fprintln(os.Stderr, err)
	}
	os.Exit(1)
}

// baseFor is the transport below the retries: nil, NewClient's own (kvgate.DefaultBase: 100
// idle connections per host, a 5 s connect and a 600 s response-header timeout), unless
// every attempt is traced, over a transport with the same settings. (Below the tracer the
// client no longer sees the response-header timeout: each attempt declares the context's
// time left, with -timeout, and otherwise no wait.)
func baseFor(trace bool, start time.Time) http.RoundTripper {
	if !trace {
		return nil
	}
	return &tracer{base: kvgate.DefaultBase(), start: start}
}

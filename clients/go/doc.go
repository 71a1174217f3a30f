// Package kvgate is the Go client SDK of kvgate, an admission controller for LLM inference
// fleets. When the fleet is full the gateway answers 429 with Retry-After, retry-after-ms,
// X-RateLimit-Backpressure-Level, X-Queue-Depth and an OpenAI-shaped error body; this package
// makes Go clients answer that well, with the same policy as the Python SDK (kvgate_client):
//
//   - full-jitter exponential backoff: retry n (from 0) waits uniform(0, min(8 s, 1 s * 2^n));
//   - never sooner than the server's hint: after a hint h the wait is uniform on
//     [h, h + min(8 s, max(1 s * 2^n, h))], so clients rejected together, who all get the same
//     hint, do not all come back the instant it expires; a hint above 120 s means give up now;
//   - retries only on 429, 503 and connection errors, x-should-retry obeyed both ways, at
//     most 3 attempts per request, within a deadline (60 s, or the request context's own
//     deadline when it is sooner); not 504, which only a proxy in front of the gateway sends
//     while the generation may still be running (see RetryableStatuses);
//   - a retry budget shared by all requests of a client: each request earns 0.1 token, each
//     retry spends one, so under sustained 429s a client adds at most about 10% more attempts;
//   - the client's own timeout, declared on every attempt as the OpenAI SDKs declare their
//     read timeout (X-Stainless-Read-Timeout: the context's time left, or the response-header
//     timeout if sooner), so that a request still queued at the gateway when the client would
//     give up gets its 429 and hint instead, and one released has the time to generate a
//     whole answer.
//
// The policy is data (Policy, the exported constants) and a pure function (BackoffDelay); the
// decision engine (Retrier, RetryState) never sleeps and never does I/O, so it runs under an
// injected Clock and random source in tests. Transport applies it below any *http.Client as an
// http.RoundTripper: community OpenAI clients that accept an *http.Client gain it by changing
// how that client is built. Client is a small typed client for chat completions and
// completions, streaming included, that decodes the OpenAI error shape into *APIError and
// *RateLimitError.
//
// The file clients/vectors/retry_policy.json of the kvgate repository holds the decisions and
// delays both SDKs must compute for the same inputs; the tests of both read it.
package kvgate

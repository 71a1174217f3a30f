package kvgate

import (
	"errors"
	"math"
	"time"
)

// BaseDelay is the first backoff window. One second, like Kubernetes APF, rather than the
// OpenAI SDK's 0.5 s: an LLM request holds KV-cache for seconds, so coming back sooner than
// that only meets the same full cache again.
const BaseDelay = 1 * time.Second

// MaxDelay is the largest backoff window (without a server hint), the OpenAI SDK's cap.
const MaxDelay = 8 * time.Second

// MaxAttempts is the number of attempts per logical request, the first one included (Google
// SRE: at most 3 per request).
const MaxAttempts = 3

// Deadline bounds a logical request's retries: no attempt starts and no backoff sleep ends
// after it. It does not cut off a response already being received.
const Deadline = 60 * time.Second

// MaxRetryAfter is the longest server hint worth waiting for: a longer one means "not in any
// useful time", so the client gives up and reports the 429 at once, as the OpenAI SDK does.
const MaxRetryAfter = 120 * time.Second

// HintSpread is the smallest width of the jitter window above a server hint, as a fraction of
// the hint. Clients rejected in the same instant all receive (nearly) the same hint; spreading
// their returns evenly over a window as long as the wait caps the returning rate at N / hint,
// the rate at which kvgate's gateway expects its queue to drain.
const HintSpread = 1.0

// RetryableStatuses returns the statuses worth another attempt: the gateway's backpressure
// (429) and an unavailable gateway or node (503: Redis unreachable, a node unreachable, a
// gateway shutting down), which did not run the request. A 500 is a bug or a bad request in
// disguise; retrying it only adds load. Each call returns a new slice.
//
// Not 504, although the official OpenAI SDKs retry it (they retry every status >= 500, and 408
// and 409). kvgate's gateway never sends 504: one comes from a proxy in front of it that gave
// up waiting, and the gateway sends a whole answer's status line only with its last token, so
// the generation may still be running on a GPU. A retry runs it a second time and takes as
// long, into the same proxy timeout: up to MaxAttempts times the GPU work, and no answer. That
// is the reason read timeouts are not retried either (IsConnectionError); a 504 is a read
// timeout one hop further out. Where a 504 is known to mean the request never reached the
// gateway, add it to Policy.RetryableStatuses, or have the proxy send x-should-retry: true.
func RetryableStatuses() []int { return []int{429, 503} }

// Policy holds the knobs of the retry loop. Start from DefaultPolicy and change fields; the
// zero Policy is not valid (MaxAttempts must be at least 1).
type Policy struct {
	// BaseDelay is the first backoff window; retry n's window is BaseDelay * 2^n.
	BaseDelay time.Duration
	// MaxDelay caps the backoff window.
	MaxDelay time.Duration
	// MaxAttempts counts the first attempt: 1 means never retry.
	MaxAttempts int
	// Deadline bounds the retries of one logical request, measured from its first attempt;
	// 0 means no deadline of the policy's own (a request context's deadline still applies).
	Deadline time.Duration
	// MaxRetryAfter: a server hint above it ends the request at once.
	MaxRetryAfter time.Duration
	// HintSpread is the jitter window above a hint, as a fraction of the hint (at least).
	HintSpread float64
	// RetryableStatuses lists the statuses retried without an x-should-retry header.
	RetryableStatuses []int
}

// DefaultPolicy returns the policy of the exported constants.
func DefaultPolicy() Policy {
	return Policy{
		BaseDelay:         BaseDelay,
		MaxDelay:          MaxDelay,
		MaxAttempts:       MaxAttempts,
		Deadline:          Deadline,
		MaxRetryAfter:     MaxRetryAfter,
		HintSpread:        HintSpread,
		RetryableStatuses: RetryableStatuses(),
	}
}

// Validate reports the first field out of its range, or nil.
func (p Policy) Validate() error {
	switch {
	case p.BaseDelay < 0 || p.MaxDelay < 0:
		return errors.New("kvgate: BaseDelay and MaxDelay must be >= 0")
	case p.MaxAttempts < 1:
		return errors.New("kvgate: MaxAttempts must be >= 1 (1 means: never retry)")
	case p.Deadline < 0:
		return errors.New("kvgate: Deadline must be > 0, or 0 for none")
	case p.MaxRetryAfter < 0 || p.HintSpread < 0 || math.IsNaN(p.HintSpread):
		return errors.New("kvgate: MaxRetryAfter and HintSpread must be >= 0")
	}
	return nil
}

// Retryable reports whether status is in p.RetryableStatuses.
func (p Policy) Retryable(status int) bool {
	for _, s := range p.RetryableStatuses {
		if s == status {
			return true
		}
	}
	return false
}

// Delay is BackoffDelay with the policy's base, cap and spread.
func (p Policy) Delay(attempt int, hint time.Duration, u float64) time.Duration {
	return BackoffDelay(attempt, p.BaseDelay, p.MaxDelay, hint, p.HintSpread, u)
}

func (p Policy) clone() Policy {
	p.RetryableStatuses = append([]int(nil), p.RetryableStatuses...)
	return p
}

// BackoffWindow returns min(ceiling, base * 2^attempt) without overflowing for absurd attempt
// numbers; a negative attempt counts as 0.
func BackoffWindow(attempt int, base, ceiling time.Duration) time.Duration {
	return toDuration(window(attempt, base, ceiling))
}

func window(attempt int, base, ceiling time.Duration) float64 {
	if attempt < 0 {
		attempt = 0
	}
	// 2^1100 overflows a float64; any attempt past 64 is at the cap for sane inputs anyway.
	if attempt > 64 {
		attempt = 64
	}
	return math.Min(float64(ceiling), float64(base)*math.Pow(2, float64(attempt)))
}

// BackoffDelay returns the wait before retry number attempt + 1 (attempt 0 follows the first
// failure). It is a pure function of its inputs: u is a random draw, uniform on [0, 1).
//
// Without a hint (hint <= 0): full jitter, u * min(ceiling, base * 2^attempt), uniform on
// [0, min(ceiling, base * 2^attempt)]. With a hint h > 0: h + u * W where
// W = min(ceiling, max(base * 2^attempt, spread * h)), uniform on [h, h + W]: never sooner than
// the server asked, and the returns still spread.
func BackoffDelay(attempt int, base, ceiling, hint time.Duration, spread, u float64) time.Duration {
	w := window(attempt, base, ceiling)
	if hint <= 0 {
		return toDuration(u * w)
	}
	w = math.Min(float64(ceiling), math.Max(w, spread*float64(hint)))
	return toDuration(float64(hint) + u*w)
}

// toDuration rounds nanoseconds held in a float64 to a Duration, saturating at the ends.
func toDuration(ns float64) time.Duration {
	switch {
	case math.IsNaN(ns) || ns <= 0:
		return 0
	case ns >= math.MaxInt64:
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(math.Round(ns))
}

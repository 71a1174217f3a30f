package kvgate

import (
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"fmt"
	"math/rand"
	"net/http"
	"sync"
	"time"
)

// Reasons a logical request ends, as counted in Stats.Outcomes. The strings are those of the
// Python SDK, so both SDKs' counters and the shared test vectors read the same.
const (
	// OutcomeOK: a response below 400, returned to the caller.
	OutcomeOK = "ok"
	// OutcomeNotRetryable: an error status outside the policy's retryable set.
	OutcomeNotRetryable = "not_retryable"
	// OutcomeServerSaidNo: x-should-retry: false.
	OutcomeServerSaidNo = "server_said_no"
	// OutcomeHintTooLong: a Retry-After above the policy's MaxRetryAfter.
	OutcomeHintTooLong = "hint_too_long"
	// OutcomeMaxAttempts: the policy's MaxAttempts were made.
	OutcomeMaxAttempts = "max_attempts"
	// OutcomeDeadline: the next attempt would start after the deadline.
	OutcomeDeadline = "deadline"
	// OutcomeBudget: the retry budget was empty.
	OutcomeBudget = "budget"
	// OutcomeError: an error that is not a connection error (a timeout, a canceled context).
	OutcomeError = "error"
	// OutcomeCanceled: the request's context ended during a backoff sleep.
	OutcomeCanceled = "canceled"
	// OutcomeNotReplayable: a retry was called for, but the request's body cannot be sent
	// again (it has no GetBody).
	OutcomeNotReplayable = "not_replayable"
)

// Decision is the verdict on one attempt: retry after Delay, or stop for Reason.
type Decision struct {
	// Retry is true when another attempt is to be sent after Delay.
	Retry bool
	// Delay is the wait before the next attempt; 0 when Retry is false.
	Delay time.Duration
	// Reason is why: one of the Outcome constants when Retry is false; a description of the
	// failure ("status 429", "connection error") when it is true.
	Reason string
}

// Clock is the time source of the retry loop; tests inject one that moves only when slept on.
// Now must return wall-clock times comparable with context deadlines and HTTP dates.
type Clock interface {
	Now() time.Time
	// Sleep waits d, or returns ctx.Err() as soon as ctx is done.
	Sleep(ctx context.Context, d time.Duration) error
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// SystemClock returns the real clock: time.Now and a timer that a context interrupts.
func SystemClock() Clock { return systemClock{} }

// NewRand returns a goroutine-safe uniform [0, 1) source from math/rand, seeded with seed.
func NewRand(seed int64) func() float64 {
	var mu sync.Mutex
	r := rand.New(rand.NewSource(seed))
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Float64()
	}
}

// randomSeed draws from the operating system, so that processes started in the same instant
// (a fleet of batch workers) do not draw the same delays; math/rand's global source would.
func randomSeed() int64 {
	var b [8]byte
	if _, err := crand.Read(b[:]); err != nil {
		return time.Now().UnixNano()
	}
	return int64(binary.LittleEndian.Uint64(b[:]))
}

// RetrierOptions configures a Retrier; every field is optional.
type RetrierOptions struct {
	// Policy defaults to DefaultPolicy().
	Policy *Policy
	// Budget defaults to a new NewDefaultBudget(); pass one Budget to several Retriers to
	// bound them together.
	Budget *Budget
	// Clock defaults to SystemClock().
	Clock Clock
	// Rand returns draws uniform on [0, 1); it defaults to NewRand with a seed from the
	// operating system. It must be safe for concurrent use.
	Rand func() float64
	// Logf, when set, receives one line per retry and per give-up (Printf-style).
	Logf func(format string, args ...interface{})
}

// Retrier is the policy, the budget, the clock and the random source: the state shared by all
// requests of one client. It is safe for concurrent use.
type Retrier struct {
	policy   Policy
	budget   *Budget
	clock    Clock
	rand     func() float64
	logf     func(format string, args ...interface{})
	mu       sync.Mutex
	requests int64
	attempts int64
	retries  int64
	outcomes map[string]int64
}

// Stats are the counters of one Retrier: logical requests, attempts (first ones included),
// retries, how the requests ended, and the budget's counters. A retry counts once it is sent
// (RetryState.StartRetry), not when it is decided: one whose backoff sleep is cut short was
// never sent, so it is in neither Attempts nor Retries.
type Stats struct {
	// Requests counts logical requests (first attempts).
	Requests int64 `json:"requests"`
	// Attempts counts every attempt sent, first ones included.
	Attempts int64 `json:"attempts"`
	// Retries counts the attempts sent after a first one (Attempts - Requests, once all ended).
	Retries int64 `json:"retries"`
	// Outcomes counts the ended requests by reason (the Outcome constants).
	Outcomes map[string]int64 `json:"outcomes"`
	// Budget is the retry budget's snapshot.
	Budget BudgetStats `json:"budget"`
}

// NewRetrier returns a Retrier, or an error if the policy is not valid.
func NewRetrier(o RetrierOptions) (*Retrier, error) {
	policy := DefaultPolicy()
	if o.Policy != nil {
		policy = o.Policy.clone()
	}
	if err := policy.Validate(); err != nil {
		return nil, err
	}
	r := &Retrier{policy: policy, budget: o.Budget, clock: o.Clock, rand: o.Rand, logf: o.Logf,
		outcomes: map[string]int64{}}
	if r.budget == nil {
		r.budget = NewDefaultBudget()
	}
	if r.clock == nil {
		r.clock = SystemClock()
	}
	if r.rand == nil {
		r.rand = NewRand(randomSeed())
	}
	return r, nil
}

// NewDefaultRetrier returns a Retrier with every default.
func NewDefaultRetrier() *Retrier {
	r, err := NewRetrier(RetrierOptions{})
	if err != nil {
		panic(err) // the default policy is valid
	}
	return r
}

// Policy returns a copy of the retrier's policy.
func (r *Retrier) Policy() Policy { return r.policy.clone() }

// Budget returns the retrier's budget.
func (r *Retrier) Budget() *Budget { return r.budget }

// Clock returns the retrier's clock.
func (r *Retrier) Clock() Clock { return r.clock }

// Stats returns a snapshot of the counters.
func (r *Retrier) Stats() Stats {
	r.mu.Lock()
	out := make(map[string]int64, len(r.outcomes))
	for k, v := range r.outcomes {
		out[k] = v
	}
	s := Stats{Requests: r.requests, Attempts: r.attempts, Retries: r.retries, Outcomes: out}
	r.mu.Unlock()
	s.Budget = r.budget.Stats()
	return s
}

// Begin starts a logical request whose first attempt is about to be sent. Its deadline is the
// sooner of the policy's (from now) and ctx's own; ctx is not kept.
func (r *Retrier) Begin(ctx context.Context) *RetryState {
	r.budget.RecordRequest()
	r.mu.Lock()
	r.requests++
	r.attempts++
	r.mu.Unlock()
	now := r.clock.Now()
	s := &RetryState{r: r, attempts: 1}
	if r.policy.Deadline > 0 {
		s.deadline = now.Add(r.policy.Deadline)
	}
	if ctx != nil {
		if d, ok := ctx.Deadline(); ok && (s.deadline.IsZero() || d.Before(s.deadline)) {
			s.deadline = d
		}
	}
	return s
}

func (r *Retrier) countRetry() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts++
	r.retries++
}

func (r *Retrier) countOutcome(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.outcomes[reason]++
}

// RetryState is one logical request's progress through the policy. It is used by one
// goroutine at a time (the one running the request).
//
// A decision to retry takes its token from the budget at once (so that no one sleeps for a
// retry the budget would refuse), but counts the retry only when the caller sends it: call
// StartRetry after the backoff sleep, or Stop if the retry is not sent, which gives the token
// back. Reporting the next outcome (AfterResponse, AfterError) without calling StartRetry
// first counts the retry as sent.
type RetryState struct {
	r        *Retrier
	deadline time.Time // zero: none
	attempts int
	// retryPending: a retry was decided (its token taken) and neither sent nor given up.
	retryPending bool
}

// Attempts returns the attempts sent so far, the first one included.
func (s *RetryState) Attempts() int { return s.attempts }

// StartRetry counts the retry decided last as sent and returns its number (the attempts sent
// before it), the value of the x-kvgate-retry-count header. It panics if no retry is pending.
func (s *RetryState) StartRetry() int {
	if !s.retryPending {
		panic("kvgate: StartRetry without a decision to retry")
	}
	s.retryPending = false
	s.attempts++
	s.r.countRetry()
	return s.attempts - 1
}

// outcomeReported: an outcome can only be the pending retry's, so it was sent.
func (s *RetryState) outcomeReported() {
	if s.retryPending {
		s.StartRetry()
	}
}

// Deadline returns the time after which no attempt starts, and false if there is none.
func (s *RetryState) Deadline() (time.Time, bool) { return s.deadline, !s.deadline.IsZero() }

// AfterResponse decides on an attempt that produced a status line. A status below 400 ends
// the request (OutcomeOK). x-should-retry beats the status table both ways: "false" stops any
// status, "true" retries any error status; without it only the policy's RetryableStatuses are
// retried, never sooner than the response's Retry-After hint.
func (s *RetryState) AfterResponse(status int, h http.Header) Decision {
	s.outcomeReported()
	reason, hint := s.classify(status, h)
	if reason != "" {
		return s.stop(reason)
	}
	return s.retryOrStop(hint, fmt.Sprintf("status %d", status))
}

// afterUnreplayable is AfterResponse for a request whose body cannot be sent again: a
// response the policy would retry ends with OutcomeNotReplayable, and no token is spent.
func (s *RetryState) afterUnreplayable(status int, h http.Header) Decision {
	s.outcomeReported()
	if reason, _ := s.classify(status, h); reason != "" {
		return s.stop(reason)
	}
	return s.stop(OutcomeNotReplayable)
}

// classify returns the outcome of a response that is not to be retried whatever the
// attempts, deadline and budget, or "" and the hint (< 0: none) of one that may be.
func (s *RetryState) classify(status int, h http.Header) (string, time.Duration) {
	if status < 400 {
		return OutcomeOK, 0
	}
	hints := ParseHints(h, s.r.clock.Now())
	if hints.ShouldRetry == ServerSaysNo {
		return OutcomeServerSaidNo, 0
	}
	if hints.ShouldRetry == ServerSilent && !s.r.policy.Retryable(status) {
		return OutcomeNotRetryable, 0
	}
	if hints.HasRetryAfter {
		return "", hints.RetryAfter
	}
	return "", -1
}

// AfterError decides on an attempt that failed without a status line. Only a connection error
// (retryable, see IsConnectionError) can be retried.
func (s *RetryState) AfterError(err error, retryable bool) Decision {
	s.outcomeReported()
	if !retryable {
		return s.stop(OutcomeError)
	}
	return s.retryOrStop(-1, fmt.Sprintf("connection error (%v)", err))
}

// Stop ends the request for reason (an Outcome constant) and counts it; for a caller that
// stops without asking the policy (a canceled sleep, a body that cannot be replayed). A retry
// decided but not started is given up: it is not counted, and its token goes back to the
// budget.
func (s *RetryState) Stop(reason string) Decision { return s.stop(reason) }

// retryOrStop applies the checks in the Python SDK's order: hint too long, attempts, deadline,
// then the budget last, so that a token is taken only for a retry every other rule allows
// (stop gives it back if the retry is then never sent). hint < 0 means no hint.
func (s *RetryState) retryOrStop(hint time.Duration, why string) Decision {
	p := &s.r.policy
	if hint > p.MaxRetryAfter {
		return s.stop(OutcomeHintTooLong)
	}
	if s.attempts >= p.MaxAttempts {
		return s.stop(OutcomeMaxAttempts)
	}
	delay := p.Delay(s.attempts-1, hint, s.r.rand())
	if !s.deadline.IsZero() && s.r.clock.Now().Add(delay).After(s.deadline) {
		return s.stop(OutcomeDeadline)
	}
	if !s.r.budget.TrySpend() {
		return s.stop(OutcomeBudget)
	}
	s.retryPending = true
	if s.r.logf != nil {
		s.r.logf("kvgate: %s, retry %d in %v", why, s.attempts, delay)
	}
	return Decision{Retry: true, Delay: delay, Reason: why}
}

func (s *RetryState) stop(reason string) Decision {
	if s.retryPending {
		s.retryPending = false
		s.r.budget.Refund()
	}
	d := Decision{Reason: reason}
	s.r.countOutcome(reason)
	if s.r.logf != nil && reason != OutcomeOK {
		s.r.logf("kvgate: not retrying (%s) after %d attempt(s)", reason, s.attempts)
	}
	return d
}

package kvgate

import (
	"errors"
	"fmt"
	"sync"
)

// EarnPerRequest is the fraction of a token each logical request (its first attempt) earns:
// retries stay within 10% of requests, Google SRE's per-client ratio.
const EarnPerRequest = 0.1

// RetryCost is what one retry spends.
const RetryCost = 1.0

// MaxTokens is the bucket's size and its content at start. Full at start so that a fresh
// client (a one-shot program) can still retry its first request; small so that a long quiet
// spell cannot bank a retry burst.
const MaxTokens = 10.0

// spendEpsilon absorbs float sums: ten earnings of 0.1 add up to 0.9999999999999999, not 1.
const spendEpsilon = 1e-9

// BudgetOptions configures a Budget. Start from DefaultBudgetOptions and change fields.
type BudgetOptions struct {
	// EarnPerRequest is added (up to MaxTokens) by each first attempt; >= 0.
	EarnPerRequest float64
	// RetryCost is taken by each retry; > 0.
	RetryCost float64
	// MaxTokens bounds the bucket; >= 0.
	MaxTokens float64
	// InitialTokens is the content at start, within [0, MaxTokens]. 0 makes the bound
	// exact from the first request: attempts <= (1 + EarnPerRequest) * requests.
	InitialTokens float64
}

// DefaultBudgetOptions returns the options of the exported constants, the bucket full.
func DefaultBudgetOptions() BudgetOptions {
	return BudgetOptions{
		EarnPerRequest: EarnPerRequest,
		RetryCost:      RetryCost,
		MaxTokens:      MaxTokens,
		InitialTokens:  MaxTokens,
	}
}

// Budget is a retry token bucket that bounds the extra load retries can add: each first
// attempt earns a fraction of a token, each retry spends a whole one. Under sustained
// rejection a client therefore sends at most EarnPerRequest extra attempts per logical request
// (plus the bucket's content), however many attempts the per-request policy allows. Backoff
// alone spreads retries in time; only a budget bounds their number. Share one Budget among all
// the requests (and clients) whose load it should bound; it is safe for concurrent use.
type Budget struct {
	opts          BudgetOptions
	mu            sync.Mutex
	tokens        float64
	firstAttempts int64
	retries       int64
	retriesDenied int64
}

// BudgetStats is a consistent snapshot of a Budget's counters.
type BudgetStats struct {
	// Tokens is the bucket's content.
	Tokens float64 `json:"tokens"`
	// FirstAttempts counts the requests that earned tokens.
	FirstAttempts int64 `json:"first_attempts"`
	// Retries counts the retries the bucket paid for.
	Retries int64 `json:"retries"`
	// RetriesDenied counts the retries refused for want of tokens.
	RetriesDenied int64 `json:"retries_denied"`
}

// NewBudget returns a budget, or an error naming the option out of range.
func NewBudget(o BudgetOptions) (*Budget, error) {
	if !(o.EarnPerRequest >= 0) || !(o.RetryCost > 0) || !(o.MaxTokens >= 0) {
		return nil, errors.New("kvgate: EarnPerRequest >= 0, RetryCost > 0 and MaxTokens >= 0 required")
	}
	if !(o.InitialTokens >= 0 && o.InitialTokens <= o.MaxTokens) {
		return nil, fmt.Errorf("kvgate: InitialTokens %v not within [0, MaxTokens=%v]", o.InitialTokens, o.MaxTokens)
	}
	return &Budget{opts: o, tokens: o.InitialTokens}, nil
}

// NewDefaultBudget returns a budget with DefaultBudgetOptions.
func NewDefaultBudget() *Budget {
	b, err := NewBudget(DefaultBudgetOptions())
	if err != nil {
		panic(err) // the defaults are valid
	}
	return b
}

// Options returns the options the budget was built with.
func (b *Budget) Options() BudgetOptions { return b.opts }

// RecordRequest notes that a logical request made its first attempt: it earns a fraction of
// a token.
func (b *Budget) RecordRequest() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.firstAttempts++
	b.tokens += b.opts.EarnPerRequest
	if b.tokens > b.opts.MaxTokens {
		b.tokens = b.opts.MaxTokens
	}
}

// TrySpend takes the cost of one retry; it returns false (and counts a denial) when the
// bucket cannot pay it.
func (b *Budget) TrySpend() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tokens+spendEpsilon >= b.opts.RetryCost {
		b.tokens -= b.opts.RetryCost
		if b.tokens < 0 {
			b.tokens = 0
		}
		b.retries++
		return true
	}
	b.retriesDenied++
	return false
}

// Refund gives back what TrySpend took for a retry that was then never sent (its backoff
// sleep was canceled); it no longer counts among Retries either.
func (b *Budget) Refund() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokens += b.opts.RetryCost
	if b.tokens > b.opts.MaxTokens {
		b.tokens = b.opts.MaxTokens
	}
	if b.retries > 0 {
		b.retries--
	}
}

// Stats returns a snapshot of the counters.
func (b *Budget) Stats() BudgetStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return BudgetStats{
		Tokens:        b.tokens,
		FirstAttempts: b.firstAttempts,
		Retries:       b.retries,
		RetriesDenied: b.retriesDenied,
	}
}

// String describes the budget's state, for logs.
func (b *Budget) String() string {
	s := b.Stats()
	return fmt.Sprintf("Budget(tokens=%.2f, first_attempts=%d, retries=%d, retries_denied=%d)",
		s.Tokens, s.FirstAttempts, s.Retries, s.RetriesDenied)
}

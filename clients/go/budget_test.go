package kvgate

import (
	"math"
	"net/http"
	"sync"
	"testing"
)

func TestBudgetStartsFullEarnsAndSpends(t *testing.T) {
	opts := DefaultBudgetOptions()
	opts.MaxTokens, opts.InitialTokens = 2, 2
	b, err := NewBudget(opts)
	if err != nil {
		t.Fatal(err)
	}
	if !b.TrySpend() || !b.TrySpend() || b.TrySpend() {
		t.Fatal("two tokens must buy exactly two retries")
	}
	for i := 0; i < 10; i++ {
		b.RecordRequest()
	}
	if math.Abs(b.Stats().Tokens-1) > 1e-9 {
		t.Fatal(b.Stats())
	}
	if !b.TrySpend() { // ten earnings of 0.1 (0.9999999999999999) buy exactly one retry
		t.Fatal("ten earnings did not buy a retry")
	}
	if s := b.Stats(); s.FirstAttempts != 10 || s.Retries != 3 || s.RetriesDenied != 1 {
		t.Fatalf("%+v", s)
	}
}

func TestBudgetIsBounded(t *testing.T) {
	opts := DefaultBudgetOptions()
	opts.MaxTokens, opts.InitialTokens = 3, 0
	b, _ := NewBudget(opts)
	for i := 0; i < 1000; i++ {
		b.RecordRequest()
	}
	if b.Stats().Tokens != 3 {
		t.Fatal(b.Stats())
	}
}

func TestBudgetRejectsBadConfiguration(t *testing.T) {
	for _, mutate := range []func(*BudgetOptions){
		func(o *BudgetOptions) { o.MaxTokens, o.InitialTokens = 1, 2 },
		func(o *BudgetOptions) { o.RetryCost = 0 },
		func(o *BudgetOptions) { o.EarnPerRequest = -0.1 },
		func(o *BudgetOptions) { o.InitialTokens = math.NaN() },
	} {
		o := DefaultBudgetOptions()
		mutate(&o)
		if _, err := NewBudget(o); err == nil {
			t.Fatalf("accepted %+v", o)
		}
	}
}

func TestBudgetConcurrentCounts(t *testing.T) {
	opts := BudgetOptions{EarnPerRequest: 1, RetryCost: 1, MaxTokens: 1e9}
	b, _ := NewBudget(opts)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				b.RecordRequest()
				b.TrySpend()
			}
		}()
	}
	wg.Wait()
	s := b.Stats()
	if s.FirstAttempts != 8000 || s.Retries+s.RetriesDenied != 8000 || math.Abs(s.Tokens-float64(8000-s.Retries)) > 1e-6 {
		t.Fatalf("%+v", s)
	}
}

// Under sustained 429s the budget, not the per-request limit of 3 attempts, bounds the load:
// about 10% more attempts than logical requests, from concurrent goroutines sharing a client.
func TestSustained429AddsAboutTenPercent(t *testing.T) {
	for _, initial := range []float64{0, MaxTokens} {
		var mu sync.Mutex
		attempts := 0
		base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			mu.Lock()
			attempts++
			mu.Unlock()
			return stubResponse(req, 429, http.Header{"Retry-After-Ms": {"100"}}), nil
		})
		opts := DefaultBudgetOptions()
		opts.InitialTokens = initial
		budget, _ := NewBudget(opts)
		transport := NewTransport(base, mustRetrier(t, RetrierOptions{Budget: budget, Clock: newFakeClock(), Rand: NewRand(1)}))
		client := &http.Client{Transport: transport}
		const workers, each = 8, 125
		requests := workers * each
		var wg sync.WaitGroup
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < each; i++ {
					resp, err := client.Get("http://gw.invalid/")
					if err != nil || resp.StatusCode != 429 {
						t.Errorf("got %v %v", resp, err)
						return
					}
					resp.Body.Close()
				}
			}()
		}
		wg.Wait()
		retries := attempts - requests
		// Without the budget, 3 attempts per request would have tripled the load.
		if float64(retries) > EarnPerRequest*float64(requests)+initial {
			t.Fatalf("initial %v: %d retries for %d requests", initial, retries, requests)
		}
		if float64(retries) < EarnPerRequest*float64(requests)-1 {
			t.Fatalf("initial %v: the budget was not used: %d retries", initial, retries)
		}
		st := transport.Stats()
		if st.Attempts != int64(attempts) || st.Budget.Retries != int64(retries) || st.Budget.RetriesDenied == 0 {
			t.Fatalf("%+v", st)
		}
		if st.Outcomes[OutcomeBudget]+st.Outcomes[OutcomeMaxAttempts] != int64(requests) {
			t.Fatalf("%+v", st.Outcomes)
		}
	}
}

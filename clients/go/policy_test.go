package kvgate

import (
	"context"
	"errors"
	"math"
	"math/rand"
	"net/http"
	"sort"
	"testing"
	"time"
)

const ksSamples = 2000

// ksCritical is the Kolmogorov-Smirnov critical value at alpha = 0.001:
// sqrt(-ln(alpha / 2) / 2) / sqrt(n).
var ksCritical = math.Sqrt(-math.Log(0.001/2)/2) / math.Sqrt(ksSamples)

// ksStatistic is sup |F_n(x) - F(x)|, on both sides of each step of the empirical CDF.
func ksStatistic(samples []float64, cdf func(float64) float64) float64 {
	xs := append([]float64(nil), samples...)
	sort.Float64s(xs)
	n := float64(len(xs))
	d := 0.0
	for i, x := range xs {
		d = math.Max(d, math.Max(float64(i+1)/n-cdf(x), cdf(x)-float64(i)/n))
	}
	return d
}

func uniformCDF(lo, hi float64) func(float64) float64 {
	return func(x float64) float64 { return math.Min(1, math.Max(0, (x-lo)/(hi-lo))) }
}

func TestKSStatisticHasPower(t *testing.T) {
	// The OpenAI SDK's formula, window * (1 - 0.25 U), is far from uniform on [0, window]: a
	// KS helper that accepted it would accept anything.
	rng := rand.New(rand.NewSource(7))
	window := BackoffWindow(2, 500*time.Millisecond, MaxDelay).Seconds()
	openaiLike := make([]float64, ksSamples)
	uniform := make([]float64, ksSamples)
	for i := range openaiLike {
		openaiLike[i] = window * (1 - 0.25*rng.Float64())
		uniform[i] = window * rng.Float64()
	}
	if d := ksStatistic(openaiLike, uniformCDF(0, window)); d < 10*ksCritical {
		t.Fatalf("KS %v does not reject a non-uniform sample", d)
	}
	if d := ksStatistic(uniform, uniformCDF(0, window)); d >= ksCritical {
		t.Fatalf("KS %v rejects a uniform sample", d)
	}
}

func TestDelaysAreFullJitterUniform(t *testing.T) {
	for _, attempt := range []int{0, 1, 2, 3, 4, 6} {
		u := NewRand(int64(1000 + attempt))
		window := math.Min(MaxDelay.Seconds(), BaseDelay.Seconds()*math.Pow(2, float64(attempt)))
		delays := make([]float64, ksSamples)
		for i := range delays {
			delays[i] = BackoffDelay(attempt, BaseDelay, MaxDelay, -1, HintSpread, u()).Seconds()
			if delays[i] < 0 || delays[i] > window {
				t.Fatalf("attempt %d: delay %v outside [0, %v]", attempt, delays[i], window)
			}
		}
		if d := ksStatistic(delays, uniformCDF(0, window)); d >= ksCritical {
			t.Fatalf("attempt %d: KS %v >= %v", attempt, d, ksCritical)
		}
		// Full jitter uses the whole window, not just its top (as "equal jitter" would).
		sort.Float64s(delays)
		if delays[0] > 0.01*window || delays[len(delays)-1] < 0.99*window {
			t.Fatalf("attempt %d: delays span only [%v, %v] of [0, %v]", attempt, delays[0], delays[len(delays)-1], window)
		}
	}
}

func TestDelayNeverBelowTheHintAndSpreadAboveIt(t *testing.T) {
	cases := []struct {
		attempt int
		hint    float64
	}{{0, 0.25}, {0, 3.5}, {2, 1.0}, {1, 30.0}}
	for _, c := range cases {
		u := NewRand(int64(c.hint*100) + int64(c.attempt))
		window := math.Min(MaxDelay.Seconds(), math.Max(BaseDelay.Seconds()*math.Pow(2, float64(c.attempt)), c.hint))
		delays := make([]float64, ksSamples)
		for i := range delays {
			delays[i] = DefaultPolicy().Delay(c.attempt, seconds(c.hint), u()).Seconds()
			if delays[i] < c.hint {
				t.Fatalf("%+v: delay %v below the hint", c, delays[i])
			}
		}
		if d := ksStatistic(delays, uniformCDF(c.hint, c.hint+window)); d >= ksCritical {
			t.Fatalf("%+v: KS %v >= %v", c, d, ksCritical)
		}
	}
}

// The delays the retry loop really sleeps, through the Transport, follow the formula too.
func TestTransportSleepsAreUniformOverTheWindow(t *testing.T) {
	clock := newFakeClock()
	var calls int
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		calls++
		if req.Header.Get(HeaderRetryCount) == "" {
			return stubResponse(req, 503, nil), nil
		}
		return stubResponse(req, 200, nil), nil
	})
	opts := DefaultBudgetOptions()
	opts.MaxTokens, opts.InitialTokens = 1e9, 1e9
	budget, _ := NewBudget(opts)
	r := mustRetrier(t, RetrierOptions{Clock: clock, Rand: NewRand(42), Budget: budget})
	client := &http.Client{Transport: NewTransport(base, r)}
	for i := 0; i < ksSamples; i++ {
		resp, err := client.Get("http://gw.invalid/")
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("request %d: %v %v", i, resp, err)
		}
		resp.Body.Close()
	}
	slept := clock.slept()
	if len(slept) != ksSamples || calls != 2*ksSamples {
		t.Fatalf("%d sleeps and %d calls for %d requests", len(slept), calls, ksSamples)
	}
	xs := make([]float64, len(slept))
	for i, d := range slept {
		xs[i] = d.Seconds()
	}
	if d := ksStatistic(xs, uniformCDF(0, BaseDelay.Seconds())); d >= ksCritical {
		t.Fatalf("KS %v >= %v", d, ksCritical)
	}
}

func TestARetryIsCountedWhenSentAndRefundedWhenNever(t *testing.T) {
	r, _ := budgetedRetrier(t, 2)
	s := r.Begin(context.Background())
	if !s.AfterResponse(429, http.Header{}).Retry {
		t.Fatal("429 not retried")
	}
	// Decided, not sent: the caller sleeps before it and may never send it; its token is held.
	if st := r.Stats(); st.Attempts != 1 || st.Retries != 0 || s.Attempts() != 1 || st.Budget.Tokens != 1 || st.Budget.Retries != 1 {
		t.Fatalf("%+v, %d", st, s.Attempts())
	}
	s.Stop(OutcomeCanceled)
	if st := r.Stats(); st.Requests != 1 || st.Attempts != 1 || st.Retries != 0 || st.Outcomes[OutcomeCanceled] != 1 ||
		st.Budget.Tokens != 2 || st.Budget.Retries != 0 {
		t.Fatalf("%+v", st)
	}

	s = r.Begin(context.Background())
	if !s.AfterResponse(503, http.Header{}).Retry {
		t.Fatal("503 not retried")
	}
	if n := s.StartRetry(); n != 1 {
		t.Fatalf("retry number %d", n)
	}
	if s.AfterResponse(200, http.Header{}).Retry {
		t.Fatal("200 retried")
	}
	if st := r.Stats(); st.Requests != 2 || st.Attempts != 3 || st.Retries != 1 || s.Attempts() != 2 ||
		st.Budget.Tokens != 1 || st.Budget.Retries != 1 {
		t.Fatalf("%+v, %d", st, s.Attempts())
	}
}

// A caller that drives the engine without StartRetry: the next outcome it reports is the
// retry's, so the retry was sent.
func TestReportingAnOutcomeMeansTheRetryWasSent(t *testing.T) {
	p := DefaultPolicy()
	p.MaxAttempts = 2
	r := mustRetrier(t, RetrierOptions{Policy: &p, Clock: newFakeClock(), Rand: constRand(0)})
	s := r.Begin(context.Background())
	if !s.AfterResponse(429, http.Header{}).Retry {
		t.Fatal("429 not retried")
	}
	if d := s.AfterError(errors.New("reset"), true); d.Reason != OutcomeMaxAttempts {
		t.Fatal(d)
	}
	if st := r.Stats(); st.Attempts != 2 || st.Retries != 1 || s.Attempts() != 2 {
		t.Fatalf("%+v, %d", st, s.Attempts())
	}
}

func TestZeroHintIsNoHint(t *testing.T) {
	if got := BackoffDelay(1, time.Second, 8*time.Second, 0, 1, 0.5); got != time.Second {
		t.Fatal(got)
	}
}

func TestWindowCapsAndDoesNotOverflow(t *testing.T) {
	for _, c := range []struct {
		attempt int
		want    time.Duration
	}{{0, time.Second}, {3, 8 * time.Second}, {10000, 8 * time.Second}, {-1, time.Second}} {
		if got := BackoffWindow(c.attempt, time.Second, 8*time.Second); got != c.want {
			t.Fatalf("attempt %d: %v, want %v", c.attempt, got, c.want)
		}
	}
	if got := BackoffDelay(3, time.Second, 8*time.Second, Forever, 1, 0.99); got != Forever {
		t.Fatalf("a Forever hint saturates, got %v", got)
	}
}

func TestPolicyRejectsNonsense(t *testing.T) {
	for name, mutate := range map[string]func(*Policy){
		"no attempts":     func(p *Policy) { p.MaxAttempts = 0 },
		"negative":        func(p *Policy) { p.Deadline = -time.Second },
		"negative base":   func(p *Policy) { p.BaseDelay = -1 },
		"negative spread": func(p *Policy) { p.HintSpread = -0.5 },
		"NaN spread":      func(p *Policy) { p.HintSpread = math.NaN() },
	} {
		p := DefaultPolicy()
		mutate(&p)
		if p.Validate() == nil {
			t.Fatalf("%s: accepted", name)
		}
		if _, err := NewRetrier(RetrierOptions{Policy: &p}); err == nil {
			t.Fatalf("%s: NewRetrier accepted it", name)
		}
	}
	if err := DefaultPolicy().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestOpenAISDKLimitConstant(t *testing.T) {
	// The same threshold as the official SDK; a larger hint means "give up now".
	if MaxRetryAfter != 120*time.Second || MaxAttempts != 3 {
		t.Fatal(MaxRetryAfter, MaxAttempts)
	}
}

func TestHintAboveMaximumGivesUpAtOnce(t *testing.T) {
	p := DefaultPolicy()
	p.Deadline = 0
	r := mustRetrier(t, RetrierOptions{Policy: &p, Clock: newFakeClock(), Rand: constRand(0.5)})
	d := r.Begin(context.Background()).AfterResponse(429, http.Header{"Retry-After": {"121"}})
	if d.Retry || d.Reason != OutcomeHintTooLong {
		t.Fatal(d)
	}
	if d := r.Begin(context.Background()).AfterResponse(429, http.Header{"Retry-After": {"120"}}); !d.Retry {
		t.Fatal(d)
	}
	// With the default 60 s deadline, a 100 s hint cannot be honoured in time either.
	r = mustRetrier(t, RetrierOptions{Clock: newFakeClock()})
	if d := r.Begin(context.Background()).AfterResponse(429, http.Header{"Retry-After": {"100"}}); d.Reason != OutcomeDeadline {
		t.Fatal(d)
	}
}

func TestAttemptsAreBounded(t *testing.T) {
	p := DefaultPolicy()
	p.MaxAttempts = 4
	r := mustRetrier(t, RetrierOptions{Policy: &p, Clock: newFakeClock(), Rand: constRand(0)})
	s := r.Begin(context.Background())
	var got []bool
	for i := 0; i < 5; i++ {
		got = append(got, s.AfterResponse(503, nil).Retry)
	}
	if want := []bool{true, true, true, false, false}; !equalBools(got, want) {
		t.Fatal(got)
	}
	if st := r.Stats(); st.Attempts != 4 || st.Outcomes[OutcomeMaxAttempts] != 2 {
		t.Fatalf("%+v", st)
	}
}

func TestDeadlineCountsElapsedTimeAndTheNextSleep(t *testing.T) {
	clock := newFakeClock()
	p := DefaultPolicy()
	p.MaxAttempts, p.Deadline = 10, 10*time.Second
	r := mustRetrier(t, RetrierOptions{Policy: &p, Clock: clock, Rand: constRand(0)})
	s := r.Begin(context.Background())
	clock.advance(6 * time.Second) // the first attempt itself took 6 s
	if d := s.AfterResponse(429, http.Header{"Retry-After-Ms": {"3000"}}); !d.Retry {
		t.Fatal(d) // 6 + 3 <= 10
	}
	clock.advance(3 * time.Second)
	if d := s.AfterResponse(429, http.Header{"Retry-After-Ms": {"1500"}}); d.Retry || d.Reason != OutcomeDeadline {
		t.Fatal(d) // 9 + 1.5 > 10
	}
}

func TestContextDeadlineWhenSoonerThanThePolicys(t *testing.T) {
	clock := newFakeClock()
	r := mustRetrier(t, RetrierOptions{Clock: clock, Rand: constRand(0)})
	ctx, cancel := context.WithDeadline(context.Background(), clock.Now().Add(2*time.Second))
	defer cancel()
	s := r.Begin(ctx)
	if dl, ok := s.Deadline(); !ok || !dl.Equal(clock.Now().Add(2*time.Second)) {
		t.Fatal(dl, ok)
	}
	if d := s.AfterResponse(429, http.Header{"Retry-After-Ms": {"2500"}}); d.Reason != OutcomeDeadline {
		t.Fatal(d)
	}
	// A later context deadline leaves the policy's 60 s in force.
	late, cancel2 := context.WithTimeout(context.Background(), time.Hour)
	defer cancel2()
	if dl, _ := r.Begin(late).Deadline(); !dl.Equal(clock.Now().Add(Deadline)) {
		t.Fatal(dl)
	}
}

func TestBudgetIsSpentOnlyOnRealRetries(t *testing.T) {
	r, budget := budgetedRetrier(t, 1)
	s := r.Begin(context.Background())
	if s.AfterResponse(404, nil).Retry || budget.Stats().Tokens != 1 {
		t.Fatal("a 404 spent a token")
	}
	if !s.AfterResponse(429, nil).Retry || budget.Stats().Tokens > 1e-9 {
		t.Fatal("a retry did not spend its token")
	}
}

func equalBools(a, b []bool) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

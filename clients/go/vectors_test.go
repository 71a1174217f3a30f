package kvgate

import (
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

// The shared vectors: the Python SDK's tests (tests/test_client_vectors.py) read the same file.
var vectorsPath = filepath.Join("..", "vectors", "retry_policy.json")

// Delays are compared to a microsecond: Python computes in float seconds.
const vectorTolerance = time.Microsecond

type vectorPolicy struct {
	BaseDelayS        *float64 `json:"base_delay_s"`
	MaxDelayS         *float64 `json:"max_delay_s"`
	MaxAttempts       *int     `json:"max_attempts"`
	DeadlineS         *float64 `json:"deadline_s"`
	MaxRetryAfterS    *float64 `json:"max_retry_after_s"`
	HintSpread        *float64 `json:"hint_spread"`
	RetryableStatuses []int    `json:"retryable_statuses"`
}

type vectorCase struct {
	Name           string            `json:"name"`
	Attempt        int               `json:"attempt"`
	HintS          *float64          `json:"hint_s"`
	U              float64           `json:"u"`
	ExpectedDelayS float64           `json:"expected_delay_s"`
	Policy         json.RawMessage   `json:"policy"`
	Status         int               `json:"status"`
	Headers        map[string]string `json:"headers"`
	Error          string            `json:"error"`
	ElapsedS       *float64          `json:"elapsed_s"`
	BudgetTokens   *float64          `json:"budget_tokens"`
	Expected       struct {
		Retry  bool    `json:"retry"`
		DelayS float64 `json:"delay_s"`
		Reason string  `json:"reason"`
	} `json:"expected"`
	Why string `json:"why"`
}

type vectorFile struct {
	DefaultPolicy json.RawMessage `json:"default_policy"`
	DefaultBudget struct {
		EarnPerRequest float64 `json:"earn_per_request"`
		RetryCost      float64 `json:"retry_cost"`
		MaxTokens      float64 `json:"max_tokens"`
	} `json:"default_budget"`
	Defaults struct {
		BudgetTokens float64 `json:"budget_tokens"`
		NowUnix      int64   `json:"now_unix"`
		ElapsedS     float64 `json:"elapsed_s"`
	} `json:"defaults"`
	DelayCases          []vectorCase `json:"delay_cases"`
	DecisionCases       []vectorCase `json:"decision_cases"`
	RequestTimeoutCases []struct {
		Name     string  `json:"name"`
		WaitS    float64 `json:"wait_s"`
		Expected string  `json:"expected"`
		Why      string  `json:"why"`
	} `json:"request_timeout_cases"`
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	raw, err := os.ReadFile(vectorsPath)
	if err != nil {
		t.Fatal(err)
	}
	var v vectorFile
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// applyPolicy overlays the JSON object raw on p; a null deadline_s means no deadline.
func applyPolicy(t *testing.T, p *Policy, raw json.RawMessage) {
	t.Helper()
	if len(raw) == 0 {
		return
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		t.Fatal(err)
	}
	var vp vectorPolicy
	if err := json.Unmarshal(raw, &vp); err != nil {
		t.Fatal(err)
	}
	if vp.BaseDelayS != nil {
		p.BaseDelay = seconds(*vp.BaseDelayS)
	}
	if vp.MaxDelayS != nil {
		p.MaxDelay = seconds(*vp.MaxDelayS)
	}
	if vp.MaxAttempts != nil {
		p.MaxAttempts = *vp.MaxAttempts
	}
	if d, ok := fields["deadline_s"]; ok {
		p.Deadline = 0
		if string(d) != "null" {
			p.Deadline = seconds(*vp.DeadlineS)
		}
	}
	if vp.MaxRetryAfterS != nil {
		p.MaxRetryAfter = seconds(*vp.MaxRetryAfterS)
	}
	if vp.HintSpread != nil {
		p.HintSpread = *vp.HintSpread
	}
	if vp.RetryableStatuses != nil {
		p.RetryableStatuses = vp.RetryableStatuses
	}
}

func TestVectorsStateTheDefaults(t *testing.T) {
	v := loadVectors(t)
	var p Policy
	applyPolicy(t, &p, v.DefaultPolicy)
	if !reflect.DeepEqual(p, DefaultPolicy()) {
		t.Fatalf("the file's default policy %+v is not the SDK's %+v", p, DefaultPolicy())
	}
	b := v.DefaultBudget
	if b.EarnPerRequest != EarnPerRequest || b.RetryCost != RetryCost || b.MaxTokens != MaxTokens {
		t.Fatalf("the file's default budget %+v is not the SDK's", b)
	}
	if len(v.DelayCases) < 10 || len(v.DecisionCases) < 30 {
		t.Fatalf("too few cases: %d, %d", len(v.DelayCases), len(v.DecisionCases))
	}
}

func near(got time.Duration, wantS float64) bool {
	return math.Abs(float64(got-seconds(wantS))) <= float64(vectorTolerance)
}

func TestVectorsDelay(t *testing.T) {
	for _, c := range loadVectors(t).DelayCases {
		c := c
		t.Run(c.Name, func(t *testing.T) {
			p := DefaultPolicy()
			applyPolicy(t, &p, c.Policy)
			hint := time.Duration(-1)
			if c.HintS != nil {
				hint = seconds(*c.HintS)
			}
			if got := p.Delay(c.Attempt, hint, c.U); !near(got, c.ExpectedDelayS) {
				t.Fatalf("delay %v, want %vs (%s)", got, c.ExpectedDelayS, c.Why)
			}
		})
	}
}

func TestVectorsDecision(t *testing.T) {
	v := loadVectors(t)
	for _, c := range v.DecisionCases {
		c := c
		t.Run(c.Name, func(t *testing.T) {
			p := DefaultPolicy()
			applyPolicy(t, &p, c.Policy)
			tokens := v.Defaults.BudgetTokens
			if c.BudgetTokens != nil {
				tokens = *c.BudgetTokens
			}
			opts := DefaultBudgetOptions()
			opts.MaxTokens = math.Max(MaxTokens, tokens)
			opts.InitialTokens = tokens
			budget, err := NewBudget(opts)
			if err != nil {
				t.Fatal(err)
			}
			clock := &fakeClock{now: time.Unix(v.Defaults.NowUnix, 0)}
			r := mustRetrier(t, RetrierOptions{Policy: &p, Budget: budget, Clock: clock, Rand: constRand(c.U)})
			state := r.Begin(nil)
			state.attempts = c.Attempt + 1 // attempt n follows the (n + 1)-th attempt sent
			elapsed := v.Defaults.ElapsedS
			if c.ElapsedS != nil {
				elapsed = *c.ElapsedS
			}
			clock.advance(seconds(elapsed))
			var d Decision
			if c.Error != "" {
				d = state.AfterError(errors.New("vector"), c.Error == "connection")
			} else {
				h := http.Header{}
				for name, value := range c.Headers {
					h.Add(name, value)
				}
				d = state.AfterResponse(c.Status, h)
			}
			if d.Retry != c.Expected.Retry {
				t.Fatalf("retry %v (%s), want %v (%s)", d.Retry, d.Reason, c.Expected.Retry, c.Why)
			}
			if c.Expected.Retry {
				if !near(d.Delay, c.Expected.DelayS) {
					t.Fatalf("delay %v, want %vs (%s)", d.Delay, c.Expected.DelayS, c.Why)
				}
				if budget.Stats().Retries != 1 {
					t.Fatal("a retry must spend from the budget")
				}
				return
			}
			if d.Reason != c.Expected.Reason {
				t.Fatalf("reason %q, want %q (%s)", d.Reason, c.Expected.Reason, c.Why)
			}
			if got := r.Stats().Outcomes; !reflect.DeepEqual(got, map[string]int64{c.Expected.Reason: 1}) {
				t.Fatalf("outcomes %v", got)
			}
		})
	}
}

func TestVectorsRequestTimeout(t *testing.T) {
	v := loadVectors(t)
	if len(v.RequestTimeoutCases) < 5 {
		t.Fatal(len(v.RequestTimeoutCases))
	}
	for _, c := range v.RequestTimeoutCases {
		// To the nearest nanosecond, as a Go caller spells the wait (1005 * time.Millisecond):
		// seconds() truncates, and 1.005 * 1e9 is 1004999999.9999999 in binary.
		wait := time.Duration(math.Round(c.WaitS * float64(time.Second)))
		if got := readTimeout(wait); got != c.Expected {
			t.Errorf("%s: %q, want %q (%s)", c.Name, got, c.Expected, c.Why)
		}
	}
}

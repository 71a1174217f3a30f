"""bench.fair's arithmetic on hand-made records: what an arm measures (service, share, demand
met, queue waits, throughput) and how the report judges each bar, pass and fail."""

from __future__ import annotations

from bench.fair.arm import ArmResult, ArmSpec, TenantFigures, measure
from bench.fair.lab import Tenant
from bench.fair.load import Outcome, plan
from bench.fair.report import bars, markdown

T0 = 1_000_000_000


def record(tenant: str, cost: int, released_s: float, queued_s: float | None = None
           ) -> dict[str, str]:
    r = {"tenant": tenant, "cost": str(cost), "state": "settled",
         "released_us": str(T0 + int(released_s * 1e6))}
    if queued_s is not None:
        r["queued_us"] = str(T0 + int(queued_s * 1e6))
    return r


def test_measure_counts_the_window_only() -> None:
    spec = ArmSpec("x", (Tenant("a"), Tenant("b")), {"a": 1.0, "b": 1.0}, fair=True)
    outcomes = [Outcome("a", 5.0, 200, done=6.0, tokens=100),    # in the window
                Outcome("a", 6.0, 429, code="rate_limit_exceeded"),
                Outcome("b", 7.0, 200, done=8.0, tokens=100),
                Outcome("b", 1.0, 200, done=2.0, tokens=100)]    # warm-up: not counted
    records = [record("a", 300, 5.5, queued_s=5.0),              # waited 500 ms
               record("b", 100, 7.2),                           # fast path: 0 ms
               record("b", 100, 1.0),                           # warm-up
               {"tenant": "a", "cost": "50", "state": "expired",
                "finished_us": str(T0 + 9_000_000)}]            # queued at 9 - 3 = 6 s
    r = measure(spec, outcomes, records, T0, warmup_s=4.0, duration_s=10.0,
                queue_timeout_ms=3_000, lateness=0.0, killed=None, engine_tokens=1_500.0)
    a, b = r.tenants["a"], r.tenants["b"]
    assert (a.sent, a.ok, b.sent, b.ok) == (2, 1, 1, 1)
    assert (a.demand_met, b.demand_met) == (0.5, 1.0)
    assert (a.service_tokens, b.service_tokens) == (300, 100)
    assert (a.released, b.released) == (1, 1)
    assert r.share("a") == 0.75
    assert sorted(a.waits_ms) == [500.0, 3_000.0] and b.waits_ms == [0.0]
    assert r.throughput_tps == 1_500 / 6.0
    assert r.completed_tps == 200 / 6.0
    assert r.series["a"][2] == 300 / 2.0  # released at 5.5 s: the bin 4-6 s


def test_plan_is_poisson_per_tenant_and_reproducible() -> None:
    first = plan({"a": 50.0, "b": 5.0}, 20.0, seed=3)
    again = plan({"a": 50.0, "b": 5.0}, 20.0, seed=3)
    assert [(o.tenant, o.at) for o in first] == [(o.tenant, o.at) for o in again]
    counts = {t: sum(o.tenant == t for o in first) for t in "ab"}
    assert 800 <= counts["a"] <= 1_200 and 60 <= counts["b"] <= 140
    assert [o.at for o in first] == sorted(o.at for o in first)


def _arm(name: str, service: dict[str, int], tps: float, waits: dict[str, float],
         met: float = 1.0, weights: dict[str, float] | None = None,
         completed_tps: float | None = None) -> ArmResult:
    spec = ArmSpec(name, tuple(Tenant(n, (weights or {}).get(n, 1.0)) for n in service),
                   dict.fromkeys(service, 1.0), fair=name != "fifo")
    tenants = {n: TenantFigures(sent=100, ok=round(100 * met), service_tokens=s,
                                waits_ms=[waits.get(n, 0.0)]) for n, s in service.items()}
    return ArmResult(spec, tenants, tps, completed_tps or tps, 0.0)


def test_bars_pass_and_fail_as_measured() -> None:
    results = {
        "fair": _arm("fair", {"A": 700, "B": 150, "C": 150}, 1000.0, {"B": 100.0, "C": 11.0},
                     completed_tps=1200.0),
        "fifo": _arm("fifo", {"A": 700, "B": 150, "C": 150}, 1040.0, {"B": 5000.0}),
        "alone": _arm("alone", {"B": 500, "C": 500}, 300.0, {"B": 50.0, "C": 10.0}),
        "failover": _arm("failover", {"A": 690, "B": 155, "C": 155}, 1000.0, {}),
        "weighted": _arm("weighted", {"D": 740, "E": 260}, 1000.0, {},
                         weights={"D": 3.0, "E": 1.0}),
    }
    verdicts = {b: ok for b, _, ok in bars(results)}
    assert verdicts["fair: B gets >= 90% of its demand"] is True
    assert verdicts["fair: B's P99 queue wait <= 1.2x alone's"] is False   # 100 vs 50 ms
    assert verdicts["fair: C's P99 queue wait <= 1.2x alone's"] is True    # 11 vs 10 ms
    throughput = "fair: pool throughput (tokens the engines computed) within 5% of fifo's"
    assert verdicts[throughput] is True   # -3.8%, though 15% more completed
    assert verdicts["fair: tokens of requests completed in the window, against fifo's"] is None
    assert verdicts["failover: no share moves more than 2 points"] is True  # 1 point
    assert verdicts["weighted: service within 10% of 3:1"] is True         # 2.85:1
    text = markdown(results, seed=1, command="c", capacity_rps=27, flood=20, light=0.5,
                    window=(15, 40))
    assert ("| fair: B's P99 queue wait <= 1.2x alone's | 100 ms vs 50 ms: x2.00 "
            "(queued 1 of 1 vs 1 of 1) | FAIL |") in text


def test_a_wait_of_zero_in_both_arms_passes_and_shows_no_ratio() -> None:
    results = {
        "fair": _arm("fair", {"A": 700, "B": 150, "C": 150}, 1000.0, {"C": 12.0}),
        "alone": _arm("alone", {"B": 500, "C": 500}, 300.0, {}),
    }
    found = {b: (measured, ok) for b, measured, ok in bars(results)}
    assert found["fair: B's P99 queue wait <= 1.2x alone's"] == (
        "0 ms vs 0 ms (queued 0 of 1 vs 0 of 1)", True)
    assert found["fair: C's P99 queue wait <= 1.2x alone's"] == (
        "12 ms vs 0 ms (queued 1 of 1 vs 0 of 1)", False)


def test_the_throughput_bar_reads_the_engines_not_the_completions() -> None:
    """Equal completions do not pass an arm whose engines computed 6% less."""
    results = {
        "fair": _arm("fair", {"A": 700, "B": 150, "C": 150}, 940.0, {}, completed_tps=1000.0),
        "fifo": _arm("fifo", {"A": 700, "B": 150, "C": 150}, 1000.0, {}, completed_tps=1000.0),
    }
    found = {b: (measured, ok) for b, measured, ok in bars(results)}
    assert found["fair: pool throughput (tokens the engines computed) within 5% of fifo's"] == (
        "940 vs 1000 tok/s: -6.0%", False)
    assert found["fair: tokens of requests completed in the window, against fifo's"] == (
        "1000 vs 1000 tok/s: +0.0%", None)

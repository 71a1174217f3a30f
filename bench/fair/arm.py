"""One arm of the fairness experiment, and what is measured of it.

An arm starts its own services (bench.fair.lab), sends its planned load (bench.fair.load) for
`duration_s` wall seconds, optionally kills the leading scheduler in the middle, then reads every
task record the pool kept. Figures count the window after `warmup_s`:

- a tenant's **service**: the reservations (tokens) of its tasks released in the window (the
  order fair release decides), and its **share** of the pool's;
- its **demand met**: of its requests planned in the window, the fraction answered 200;
- its **queue wait**: release time minus enqueue time of each of its tasks admitted in the
  window (0 on the fast path; a task that expired in the queue counts its whole timeout);
- the pool's **throughput**: tokens the engines computed in the window (prompt plus generated,
  from their vLLM counters read at its start and end), per second;
- its **completed** tokens: those of requests answered in the window, per second. Not the
  throughput: a request takes seconds in the engines, so this also moves with how many are in
  flight at the window's ends (an arm that admitted more early completes more in the window,
  without the engines doing more).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.openloop import sleep_until
from bench.fair.lab import Lab, LabSettings, Tenant
from bench.fair.load import Outcome, plan, run

DRAIN_S = 15.0
"""After the last planned send, answers are awaited this long, then the arm stops. Longer than
a request takes in the engines with the flood's batch running (about 7.5 s: some 270 requests
run on the two nodes, which complete about 35 a second), so that a request admitted in the
window's last seconds counts as met once it completes, not as unanswered."""


@dataclass(frozen=True, slots=True)
class ArmSpec:
    name: str
    tenants: tuple[Tenant, ...]
    rates: Mapping[str, float]
    """Requests per wall second, per tenant."""
    fair: bool
    failover_at_s: float | None = None
    """Kill the leading scheduler this many seconds after the start (None: never)."""


@dataclass(slots=True)
class TenantFigures:
    sent: int = 0
    ok: int = 0
    service_tokens: int = 0
    released: int = 0
    """Its tasks released in the window."""
    waits_ms: list[float] = field(default_factory=list)

    @property
    def demand_met(self) -> float:
        return self.ok / self.sent if self.sent else 1.0

    @property
    def queued(self) -> int:
        """Requests that waited in the queue at all (the others took the fast path)."""
        return sum(1 for w in self.waits_ms if w > 0)

    def wait_p(self, q: float) -> float:
        if not self.waits_ms:
            return 0.0
        data = sorted(self.waits_ms)
        return data[min(len(data) - 1, int(q * len(data)))]


@dataclass(slots=True)
class ArmResult:
    spec: ArmSpec
    tenants: dict[str, TenantFigures]
    throughput_tps: float
    """Tokens the engines computed per second in the window."""
    completed_tps: float
    """Tokens of requests completed in the window, per second."""
    max_send_lateness_s: float
    killed: str | None = None
    series: dict[str, list[float]] = field(default_factory=dict)
    """Tokens released per second per tenant, in bins of `BIN_S` over the whole arm."""

    def share(self, tenant: str) -> float:
        total = sum(t.service_tokens for t in self.tenants.values())
        return self.tenants[tenant].service_tokens / total if total else 0.0


BIN_S = 2.0


def measure(spec: ArmSpec, outcomes: Sequence[Outcome], records: Sequence[Mapping[str, str]],
            redis_t0_us: int, warmup_s: float, duration_s: float, queue_timeout_ms: int,
            lateness: float, killed: str | None, engine_tokens: float) -> ArmResult:
    """`engine_tokens`: what the engines computed in the window (the counters' change)."""
    tenants = {t.name: TenantFigures() for t in spec.tenants if spec.rates.get(t.name, 0) > 0}
    window = duration_s - warmup_s
    completed = 0
    for o in outcomes:
        if warmup_s <= o.at < duration_s:
            tenants[o.tenant].sent += 1
            tenants[o.tenant].ok += o.status == 200
        if o.status == 200 and warmup_s <= o.done < duration_s:
            completed += o.tokens
    bins = int(duration_s // BIN_S) + 1
    series = {name: [0.0] * bins for name in tenants}
    for r in records:
        name = r.get("tenant", "")
        if name not in tenants:
            continue
        cost = int(r.get("cost", "0"))
        if "released_us" in r:
            at = (int(r["released_us"]) - redis_t0_us) / 1e6
            if 0 <= at < duration_s:
                series[name][int(at // BIN_S)] += cost / BIN_S
            queued = int(r.get("queued_us", r["released_us"]))
            wait_ms = (int(r["released_us"]) - queued) / 1e3
            if warmup_s <= at < duration_s:
                tenants[name].service_tokens += cost
                tenants[name].released += 1
            if warmup_s <= (queued - redis_t0_us) / 1e6 < duration_s:
                tenants[name].waits_ms.append(wait_ms)
        elif r.get("state") == "expired" and "finished_us" in r:
            end = (int(r["finished_us"]) - redis_t0_us) / 1e6
            if warmup_s <= end - queue_timeout_ms / 1e3 < duration_s:
                tenants[name].waits_ms.append(float(queue_timeout_ms))
    return ArmResult(spec, tenants, engine_tokens / window, completed / window, lateness, killed,
                     series)


async def _engine_window(services: Lab, start: float, end: float) -> float:
    """The engines' counters' change between two perf_counter times."""
    await sleep_until(start)
    before = await services.engine_tokens()
    await sleep_until(end)
    return await services.engine_tokens() - before


async def run_arm(spec: ArmSpec, lab: LabSettings, seed: int, duration_s: float,
                  warmup_s: float, log_dir: Path) -> ArmResult:
    services = Lab(lab, log_dir / spec.name)
    try:
        await services.start(spec.tenants, spec.fair)
        outcomes = plan(spec.rates, duration_s, seed)
        redis_t0 = await services.redis_now_us() + 500_000
        t0 = time.perf_counter() + 0.5
        load = asyncio.create_task(run(outcomes, services.gateway_urls, t0,
                                       duration_s + DRAIN_S))
        counted = asyncio.create_task(_engine_window(services, t0 + warmup_s, t0 + duration_s))
        killed = None
        if spec.failover_at_s is not None:
            await sleep_until(t0 + spec.failover_at_s)
            killed = await services.kill_leader()
        engine_tokens = await counted
        lateness = await load
        records = await services.task_records()
    finally:
        await services.stop()
    return measure(spec, outcomes, records, redis_t0, warmup_s, duration_s,
                   lab.queue_timeout_ms, lateness, killed, engine_tokens)

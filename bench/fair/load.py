"""Open-loop load of several tenants: Poisson arrivals at a fixed rate each, drawn once from the
seed, sent on schedule through the gateways in turn, whatever the earlier requests' fate.

Every request has the same shape: a prompt of about `PROMPT_WORDS` tokens and `OUTPUT_TOKENS`
output tokens, forced on the simulated engine (`X-Sim-Output-Tokens`), with `max_tokens` the
same: its reservation is exactly what it uses, so tokens served and tokens charged agree.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from bench.common.openloop import sleep_until
from bench.fair.lab import POOL, api_key
from bench.sim.protocol import OUTPUT_TOKENS_HEADER

PROMPT_WORDS = 300
OUTPUT_TOKENS = 150
PROMPT = " ".join(["hello"] * PROMPT_WORDS)


@dataclass(slots=True)
class Outcome:
    tenant: str
    at: float
    """Planned send time, seconds after the start."""
    status: int = 0
    """HTTP status; 0: no answer before the run stopped."""
    code: str = ""
    """The error code of a refusal."""
    done: float = 0.0
    tokens: int = 0
    """Total tokens of a completed request (its usage)."""
    message: str = ""


def plan(rates: Mapping[str, float], duration_s: float, seed: int) -> list[Outcome]:
    """Each tenant's Poisson arrivals over [0, duration_s), in time order."""
    out: list[Outcome] = []
    for i, (tenant, rate) in enumerate(sorted(rates.items())):
        rng = random.Random(seed * 1_000 + i)
        t = rng.expovariate(rate) if rate > 0 else duration_s
        while t < duration_s:
            out.append(Outcome(tenant, t))
            t += rng.expovariate(rate)
    out.sort(key=lambda o: o.at)
    return out


async def _send(session: aiohttp.ClientSession, url: str, o: Outcome, t0: float) -> None:
    body = {"model": POOL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": OUTPUT_TOKENS}
    headers = {"Authorization": f"Bearer {api_key(o.tenant)}",
               OUTPUT_TOKENS_HEADER: str(OUTPUT_TOKENS)}
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers=headers) as r:
            data = await r.json(content_type=None)
            o.status = r.status
            if r.status == 200:
                o.tokens = int(data["usage"]["total_tokens"])
            else:
                err = data.get("error") or {}
                o.code = str(err.get("code", ""))
                o.message = str(err.get("message", ""))[:40]
    except (aiohttp.ClientError, ValueError) as exc:
        o.status, o.code = -1, type(exc).__name__
    o.done = time.perf_counter() - t0


async def run(outcomes: Sequence[Outcome], gateways: Sequence[str], t0: float,
              stop_at: float) -> float:
    """Send every planned request at its time (gateways in turn); at `stop_at` seconds cancel
    what is still unanswered. Returns the largest lateness of a send (s)."""
    connector = aiohttp.TCPConnector(limit=0)
    lateness = 0.0
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        for i, o in enumerate(outcomes):
            await sleep_until(t0 + o.at)
            lateness = max(lateness, time.perf_counter() - t0 - o.at)
            tasks.append(asyncio.create_task(_send(session, gateways[i % len(gateways)], o, t0)))
        remaining = t0 + stop_at - time.perf_counter()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return lateness

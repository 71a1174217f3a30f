"""Retry storm: 1,000 clients rejected in the same instant, and when they come back.

    python -m bench.perf.retry_storm [--clients N] [--repeats K] [--output FILE]

A real aiohttp server (its own process, so it has a core to itself) holds the first request of
every client until all have arrived, then answers them all with 429 at the same moment T0. For
the next second it keeps answering 429 (with the gateway's headers); after that it answers 200.
It records when each later request (a retry) arrives.

The figure of merit is peak / mean over the *return window*, in 100 ms bins:

- the window opens at T0 + h0, h0 being the shortest hint sent with the T0 rejections (T0 itself
  when they carried none): the instant the server allowed the clients back. A policy whose
  retries come sooner (the fixed delay ignores hints) opens it at its first retry instead;
- it closes at the last retry, and spans at least MIN_WINDOW_S (1 s, ten bins);
- peak = the busiest bin of the window, mean = retries / bins of the window.

Why this window. Bins before T0 + h0 are the silence the server asked for: they are the same
for every policy that obeys it, and counting them (as the first version of this bench did,
with bins from T0) bounds the figure below by (h0 + s) / s for *any* return spread evenly over
s after the hint: it then measures how long clients were told to wait, and a policy can only
improve it by making them wait longer. The window's start is still fixed by the server, not by
the arrivals, and it is at least ten bins long, so that a herd stays visible: 1,000 clients
back within one bin score 10. A window from the first to the last retry, with no minimum, would
score that herd 1.0 (a herd no wider than a bin is its own mean): it would rank the official
SDK, which returns everyone exactly when the hint expires, as the flattest policy of all. Both
other windows are reported beside it (`from T0`, `first-last`) so the choice can be checked.

Policies, all measured in the same run, each client with its own state:
- kvgate: this SDK's decision engine (kvgate_client.Retrier: hints, full jitter, budget,
  attempts, deadline), the same object RetryTransport drives;
- kvgate-go: the Go SDK (clients/go), the same policy through its whole stack: the program
  clients/go/cmd/kvgate-retrystorm, built with `go build` at the start of the run, runs the
  clients in its own process, each with its own kvgate.Retrier, its own net/http connection
  and kvgate.Transport (so its sleeps are Go timers, not this process' event loop);
- openai: the official OpenAI Python SDK's default policy, reimplemented line by line from
  openai-python `_base_client.py` (`_should_retry`, `_calculate_retry_timeout`, v3.57):
  max_retries=2, a server hint of 0 < h <= 120 s is used as is, otherwise
  min(0.5 * 2^n, 8) * (1 - 0.25 U);
- fixed: a naive client retrying every 0.5 s, hints ignored, 3 attempts.

Scenarios (server hint on each 429): `remaining` = the exact time until the server recovers
(identical for everyone rejected at T0: the worst case for a herd); `gateway` = the same time
spread upward by 0-25% per response, as kvgate's gateway does (`gateway.errors.jittered`,
`retry_jitter` = 0.25); `short` = a constant 100 ms (a hint shorter than the overload lasts);
`none` = no hint (most peers send none).

All clients talk HTTP/1.1 over their own keep-alive loopback connection. The Python arms share
one minimal client in this process: a full Python HTTP stack in one process on 2 cores would
spend longer issuing 1,000 requests than the bins are wide, and smear the very bursts being
measured. The Go arm uses net/http, which issues 1,000 requests in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from admission.config import GatewaySettings
from bench.common.golang import RETRY_STORM, build
from gateway.errors import jittered
from kvgate_client import Retrier, RetryPolicy

CLIENTS = 1000
REJECT_S = 1.0  # how long after T0 the server keeps answering 429
BIN_S = 0.1
MIN_WINDOW_S = 1.0  # the return window spans at least this (ten bins): see the module docstring
GATEWAY_JITTER = GatewaySettings().retry_jitter  # the gateway's default upward hint spread
FIXED_DELAY_S = 0.5
SHORT_HINT_MS = 100
BARRIER_TIMEOUT_S = 30.0
TARGET_RATIO = 2.0
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "retry_storm.md"
SCENARIOS = ("remaining", "gateway", "short", "none")
GO_ARM = "kvgate-go"
OURS = ("kvgate", GO_ARM)  # the arms held to the target
GO_TIMEOUT_S = 120.0


# --- the figures ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StormFigures:
    arrivals: int
    peak: int  # retries in the busiest bin of the return window
    mean: float  # retries per bin over the return window
    ratio: float  # peak / mean: the figure of merit
    start_s: float  # the return window, seconds after T0
    end_s: float
    ratio_t0: float  # peak / mean over bins from T0 to the last retry (this bench's first figure)
    ratio_span: float  # over bins from the first to the last retry, no minimum (herd-blind)
    last_s: float


def _peak(arrivals: Sequence[float], start: float, nbins: int, bin_s: float) -> int:
    bins = [0] * nbins
    for t in arrivals:
        bins[min(nbins - 1, max(0, int((t - start) / bin_s)))] += 1
    return max(bins)


def _bins(start: float, last: float, bin_s: float, min_window_s: float = 0.0) -> int:
    return max(round(min_window_s / bin_s), int((last - start) / bin_s) + 1, 1)


def storm_figures(
    arrivals: Sequence[float],
    *,
    opened_s: float = 0.0,
    bin_s: float = BIN_S,
    min_window_s: float = MIN_WINDOW_S,
) -> StormFigures:
    """The figures of one round. `arrivals`: retries, seconds after T0; `opened_s`: the shortest
    hint sent with the T0 rejections (0 without one), i.e. when the server let clients back."""
    if not arrivals:
        nan = math.nan
        return StormFigures(0, 0, 0.0, nan, opened_s, opened_s, nan, nan, 0.0)
    n = len(arrivals)
    first, last = min(arrivals), max(arrivals)
    start = min(opened_s, first)
    nbins = _bins(start, last, bin_s, min_window_s)
    peak = _peak(arrivals, start, nbins, bin_s)
    mean = n / nbins
    t0_bins = _bins(0.0, last, bin_s)
    span_bins = _bins(first, last, bin_s)
    return StormFigures(
        arrivals=n,
        peak=peak,
        mean=mean,
        ratio=peak / mean,
        start_s=start,
        end_s=start + nbins * bin_s,
        ratio_t0=_peak(arrivals, 0.0, t0_bins, bin_s) * t0_bins / n,
        ratio_span=_peak(arrivals, first, span_bins, bin_s) * span_bins / n,
        last_s=last,
    )


# --- the policies -----------------------------------------------------------------------------


class ClientPolicy(Protocol):
    def next_delay(self, status: int, headers: Mapping[str, str]) -> float | None:
        """Seconds to wait before the next attempt, or None to give up."""


class KvgatePolicy:
    def __init__(self, rand: Callable[[], float], policy: RetryPolicy | None = None) -> None:
        self._state = Retrier(policy, rand=rand).begin()

    def next_delay(self, status: int, headers: Mapping[str, str]) -> float | None:
        decision = self._state.after_response(status, headers)
        return decision.delay_s if decision.retry else None


class OpenAIDefaultPolicy:
    MAX_RETRIES = 2
    INITIAL_RETRY_DELAY = 0.5
    MAX_RETRY_DELAY = 8.0
    MAX_RETRY_AFTER_DELAY = 120.0

    def __init__(self, rand: Callable[[], float]) -> None:
        self._rand = rand
        self._retries_taken = 0

    def _hint(self, headers: Mapping[str, str]) -> float | None:
        for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
            value = headers.get(name)
            if value is None:
                continue
            try:
                return float(value) / divisor
            except ValueError:
                continue
        return None  # (the SDK also parses an HTTP date; this server never sends one)

    def next_delay(self, status: int, headers: Mapping[str, str]) -> float | None:
        if self._retries_taken >= self.MAX_RETRIES:
            return None
        hint = self._hint(headers)
        if hint is not None and math.isfinite(hint) and hint > self.MAX_RETRY_AFTER_DELAY:
            return None
        should = headers.get("x-should-retry")
        if should == "false" or (
            should != "true" and status not in (408, 409, 429) and status < 500
        ):
            return None
        n = self._retries_taken
        self._retries_taken += 1
        if hint is not None and math.isfinite(hint) and 0 < hint <= self.MAX_RETRY_AFTER_DELAY:
            return hint
        sleep = min(self.INITIAL_RETRY_DELAY * 2.0**n, self.MAX_RETRY_DELAY)
        return max(0.0, sleep * (1 - 0.25 * self._rand()))


class FixedDelayPolicy:
    def __init__(self, delay_s: float = FIXED_DELAY_S, attempts: int = 3) -> None:
        self._delay = delay_s
        self._left = attempts - 1

    def next_delay(self, status: int, headers: Mapping[str, str]) -> float | None:
        if status != 429 or self._left <= 0:
            return None
        self._left -= 1
        return self._delay


PolicyFactory = Callable[[random.Random], ClientPolicy]


def policies(hint_spread: float | None = None) -> dict[str, PolicyFactory]:
    """The compared policies; `hint_spread` overrides the SDK's HINT_SPREAD (for trade-offs)."""
    ours = RetryPolicy() if hint_spread is None else RetryPolicy(hint_spread=hint_spread)
    return {
        "kvgate": lambda rng: KvgatePolicy(rng.random, ours),
        "openai": lambda rng: OpenAIDefaultPolicy(rng.random),
        "fixed": lambda rng: FixedDelayPolicy(),
    }


def arms() -> list[str]:
    """Every arm in the order of a run: the two SDKs side by side, then the others."""
    names = list(policies())
    return [names[0], GO_ARM, *names[1:]]


# --- the server (child process) ---------------------------------------------------------------


@dataclass
class _Round:
    clients: int = CLIENTS
    hint: str = "remaining"
    seed: int = 0
    held: int = 0
    t0: float | None = None
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrivals: list[float] = field(default_factory=list)
    served_at: list[float] = field(default_factory=list)
    opened_ms: int | None = None  # the shortest hint sent with the T0 rejections
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


def _hint_ms(rnd: _Round, now: float) -> int | None:
    if rnd.hint in ("remaining", "gateway"):
        assert rnd.t0 is not None
        remaining = max(1, math.ceil((rnd.t0 + REJECT_S - now) * 1000))
        if rnd.hint == "gateway":
            return jittered(remaining, GATEWAY_JITTER, rnd.rng)
        return remaining
    if rnd.hint == "short":
        return SHORT_HINT_MS
    return None


def _reject(rnd: _Round, hint_ms: int | None) -> web.Response:
    headers = {"X-RateLimit-Backpressure-Level": "RED", "X-Queue-Depth": str(rnd.clients)}
    if hint_ms is not None:
        headers["retry-after-ms"] = str(hint_ms)
        headers["Retry-After"] = str(math.ceil(hint_ms / 1000))
    body = {
        "error": {
            "code": "capacity_exceeded",
            "message": "Cluster KV-Cache is currently saturated. Please backoff.",
            "type": "capacity_error",
            "retry_after_ms": hint_ms,
        }
    }
    return web.json_response(body, status=429, headers=headers)


def _serve(sock: socket.socket) -> None:
    rnd = _Round()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        nonlocal rnd
        now = time.monotonic()
        await request.read()
        if request.path == "/control/reset":
            cfg = json.loads(await request.read())
            rnd = _Round(clients=int(cfg["clients"]), hint=str(cfg["hint"]), seed=int(cfg["seed"]))
            return web.json_response({"ok": True})
        if request.path == "/control/results":
            opened = (rnd.opened_ms or 0) / 1000
            return web.json_response(
                {"arrivals": rnd.arrivals, "served_at": rnd.served_at, "opened_s": opened}
            )
        current = rnd
        if current.t0 is None:
            # Hold every first attempt so that all clients are rejected in the same instant.
            current.held += 1
            if current.held >= current.clients:
                current.t0 = time.monotonic()
                current.release.set()
            else:
                try:
                    await asyncio.wait_for(current.release.wait(), BARRIER_TIMEOUT_S)
                except TimeoutError:
                    current.t0 = current.t0 or time.monotonic()
                    current.release.set()
            assert current.t0 is not None
            hint_ms = _hint_ms(current, current.t0)
            if hint_ms is not None:
                current.opened_ms = min(hint_ms, current.opened_ms or hint_ms)
            return _reject(current, hint_ms)
        current.arrivals.append(now - current.t0)
        if now - current.t0 < REJECT_S:
            return _reject(current, _hint_ms(current, now))
        current.served_at.append(now - current.t0)
        return web.json_response({"ok": True})

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            web.Server(handle, access_log=None), sock=sock, backlog=4096
        )
        async with server:
            await server.serve_forever()

    _run(main())


def _run(coro: Coroutine[Any, Any, None]) -> None:
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


# --- the clients ------------------------------------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection; just enough protocol for this server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, payload

    def close(self) -> None:
        self.writer.close()


REQUEST = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Outcome:
    succeeded: int = 0
    gave_up: int = 0
    errors: int = 0


async def _client(conn: Conn, policy: ClientPolicy, go: asyncio.Event, out: Outcome) -> None:
    await go.wait()
    try:
        while True:
            status, headers, _ = await conn.post("/v1/chat/completions", REQUEST)
            if status == 200:
                out.succeeded += 1
                return
            delay = policy.next_delay(status, headers)
            if delay is None:
                out.gave_up += 1
                return
            await asyncio.sleep(delay)
    except (OSError, asyncio.IncompleteReadError):
        out.errors += 1
    finally:
        conn.close()


@dataclass(frozen=True)
class RoundResult:
    scenario: str
    policy: str
    figures: StormFigures
    outcome: Outcome
    arrivals: list[float]
    served_at: list[float]  # seconds after T0 at which each successful attempt arrived


async def _reset(port: int, scenario: str, clients: int, seed: int) -> None:
    control = await Conn.open(port)
    cfg = {"clients": clients, "hint": scenario, "seed": seed}
    await control.post("/control/reset", json.dumps(cfg).encode())
    control.close()


async def _results(port: int, scenario: str, policy: str, out: Outcome) -> RoundResult:
    control = await Conn.open(port)
    _, _, payload = await control.post("/control/results", b"{}")
    control.close()
    data = json.loads(payload)
    arrivals = [float(t) for t in data["arrivals"]]
    figures = storm_figures(arrivals, opened_s=float(data["opened_s"]))
    served = [float(t) for t in data["served_at"]]
    return RoundResult(scenario, policy, figures, out, arrivals, served)


async def _round(
    port: int, scenario: str, policy: str, factory: PolicyFactory, clients: int, seed: int
) -> RoundResult:
    await _reset(port, scenario, clients, seed)
    sem = asyncio.Semaphore(64)  # connect in waves: a SYN flood of 1,000 overflows backlogs

    async def connect() -> Conn:
        async with sem:
            return await Conn.open(port)

    conns = await asyncio.gather(*(connect() for _ in range(clients)))
    rng = random.Random(seed)
    go, out = asyncio.Event(), Outcome()
    tasks = [
        asyncio.create_task(_client(c, factory(random.Random(rng.random())), go, out))
        for c in conns
    ]
    go.set()
    await asyncio.gather(*tasks)
    return await _results(port, scenario, policy, out)


async def _go_round(port: int, scenario: str, binary: Path, clients: int, seed: int) -> RoundResult:
    """The Go arm: the same round, its clients in the Go program's process."""
    await _reset(port, scenario, clients, seed)
    proc = await asyncio.create_subprocess_exec(
        str(binary), "-url", f"http://127.0.0.1:{port}/v1/chat/completions",
        "-clients", str(clients), "-seed", str(seed),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), GO_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary.name} exited with {proc.returncode}: {stderr.decode()}")
    data = json.loads(stdout)
    out = Outcome(succeeded=data["succeeded"], gave_up=data["gave_up"], errors=data["errors"])
    return await _results(port, scenario, GO_ARM, out)


def _histogram(arrivals: Sequence[float], until: float) -> str:
    bins = [0] * (int(until / BIN_S) + 1)
    for t in arrivals:
        if t <= until:
            bins[int(t / BIN_S)] += 1
    return " ".join(str(b) for b in bins)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _share_range(
    groups: Mapping[tuple[str, str], list[RoundResult]],
    clients: int,
    scenarios: Sequence[str],
    names: Sequence[str],
) -> str:
    """The range of the median worst-100-ms shares of some policies in some scenarios."""
    shares = [
        _median([100.0 * r.figures.peak / clients for r in rs])
        for (scenario, policy), rs in groups.items()
        if scenario in scenarios and policy in names
    ]
    if not shares:
        return "n/a"
    lo, hi = min(shares), max(shares)
    return f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}%"


def _report(results: list[RoundResult], clients: int, repeats: int, elapsed: float) -> str:
    lines = [
        "# Retry storm",
        "",
        f"`python -m bench.perf.retry_storm --clients {clients} --repeats {repeats}`: "
        f"{clients} clients rejected with 429 at the same instant T0; the server answers 429 until"
        f" T0 + {REJECT_S:.0f} s, then 200. Retries are counted at the server in 100 ms bins."
        f" **peak / mean** = the busiest bin over the mean bin of the *return window*, which"
        f" opens at T0 + h0 (h0 = the shortest hint sent with the T0 rejections, 0 without one:"
        f" when the server let clients back; or at the first retry, if a policy came sooner),"
        f" closes at the last retry and spans at least {MIN_WINDOW_S:.0f} s (ten bins)."
        f" 1.0 = perfectly even. Target for both SDKs (kvgate, kvgate-go): peak / mean <="
        f" {TARGET_RATIO:.0f}."
        " Why this window, in short: the bins before T0 + h0 are the silence the server asked"
        " for, the same for every policy that obeys it; counting them (`from T0`, this bench's"
        " first figure) bounds the ratio below by (h0 + s) / s for any return spread evenly over s"
        " after the hint, so it rewards longer waits, not flatter returns. A window from the"
        " first to the last retry with no minimum (`first-last`) is blind to herds: 1,000"
        " clients back within one bin score 1.0 there, 10 here. Both are shown for comparison;"
        " the full argument is in `bench/perf/retry_storm.py`.",
        "",
        "**worst 100 ms** = the busiest bin as a share of all clients; **served at** = mean time"
        " after T0 at which the clients that succeeded got through (what the spread costs them;"
        f" the server recovers at {REJECT_S:.0f} s). Medians over the repeats, [min - max] in"
        " brackets.",
        "",
        f"Machine: {platform.machine()}, {mp.cpu_count()} cores, Python "
        f"{platform.python_version()}; whole run {elapsed:.1f} s; load average at the end"
        f" {os.getloadavg()[0]:.2f} (other work on the machine smears the bursts: rerun when"
        " it is well below the core count). Policies as described in"
        " `bench/perf/retry_storm.py`: kvgate = the Python SDK's decision engine with its default"
        " policy; kvgate-go = the Go SDK (clients/go) with its default policy, its whole stack"
        " (kvgate.Transport over net/http, one connection per client) in its own process;"
        " openai = the official SDK's default policy, reimplemented from its source (not the"
        " SDK's HTTP stack); fixed = every 0.5 s, hints ignored, 3 attempts.",
        "",
        "| scenario (hint) | policy | retries | peak / mean | from T0 | first-last "
        "| worst 100 ms | return window | served at | succeeded | gave up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[RoundResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.policy), []).append(r)
    verdicts: list[str] = []
    for (scenario, policy), rs in groups.items():
        ratios = [r.figures.ratio for r in rs]
        shares = [100.0 * r.figures.peak / clients for r in rs]
        served = _median([_mean(r.served_at) for r in rs])
        lines.append(
            f"| {scenario} | {policy} | {_median([r.figures.arrivals for r in rs]):.0f} | "
            f"**{_median(ratios):.2f}** [{min(ratios):.2f} - {max(ratios):.2f}] | "
            f"{_median([r.figures.ratio_t0 for r in rs]):.2f} | "
            f"{_median([r.figures.ratio_span for r in rs]):.2f} | "
            f"{_median(shares):.1f}% | "
            f"{_median([r.figures.start_s for r in rs]):.2f}-"
            f"{_median([r.figures.end_s for r in rs]):.2f} s | "
            f"{'-' if math.isnan(served) else f'{served:.2f} s'} | "
            f"{_median([r.outcome.succeeded for r in rs]):.0f} | "
            f"{_median([r.outcome.gave_up + r.outcome.errors for r in rs]):.0f} |"
        )
        if policy in OURS:
            met = "met" if max(ratios) <= TARGET_RATIO else "**not met**"
            verdicts.append(
                f"{policy} `{scenario}` {met} ({_median(ratios):.2f}, worst {max(ratios):.2f})"
            )
    if verdicts:
        lines += ["", f"The SDKs against the target (every repeat): {'; '.join(verdicts)}."]
    lines += [
        "",
        "Reading the figures:",
        "",
        "- `remaining`, `gateway`: the SDK waits uniformly on [h, h + max(1 s, h)] after a hint h,"
        " so its retries come back flat; in `remaining` what is left of the ratio is the"
        " sampling noise of 1,000 independent draws over ten-odd bins (the busiest of ten bins"
        " of ~100 holds ~125). In `gateway` each client's h is its own, between 1 and 1.25 s,"
        " and the union of the [h, 2h] is a trapezoid (ramps over [1, 1.25] and [2, 2.5] s):"
        " 1.33 in expectation before noise. The official SDK returns every client the instant"
        " its hint expires: one bin, (nearly) 100% of the clients, in `remaining`; the"
        " gateway's own 0-25% jitter spreads that herd over 250 ms only. The price of the"
        " spread is in `served at`: about 1.5 h on average instead of h. On a loaded machine"
        " the one process running the Python arms' clients issues a herd over a few bins,"
        " which lowers the openai and fixed figures (a herd measured as less of one), not"
        " kvgate's: read them with the load average above.",
        "- kvgate-go draws from the same distributions as kvgate (the two SDKs compute the same"
        " delays for the same draws: clients/vectors/retry_policy.json), so its figures differ"
        " from kvgate's by sampling noise and by what its client stack adds: Go timers and"
        " net/http in a process of its own, against one asyncio loop for 1,000 Python clients.",
        "- `from T0` is what this bench first reported: with the hint's second of silence"
        " counted, an even return over s = 1 s after h = 1 s scores (h + s) / s = 2 before any"
        " noise. `first-last` shows why the return window has a fixed start and a minimum"
        " length: there the official SDK's herds score about 1 to 1.6, as if they were flat.",
        "- `short`, `none`, kvgate and kvgate-go: with no hint, or a hint much shorter than"
        " the overload, the delays are the issue's full jitter, random(0, min(8 s, 1 s x 2^n)),"
        " and two waves overlap inside the 1 s overload: first retries at 1,000/s over"
        " [0, 1 s], second retries (first retry + U[0, 2 s]) ramping up to 500/s by 1 s, flat"
        " to 2 s, down to 0 at 3 s. The busiest bin, just before 1 s, runs at ~1,500/s; the"
        " mean over [0, 3 s] is 2,000 / 3 s: 2.25 in expectation, plus noise. No base delay b"
        " brings it under 2: a longer one lets the first retries after 1 s through, but the"
        " second wave of the others still stretches the window to 1 s + 2b, for"
        " (2 + 2r + r^2 / 2) / (1 + r) with r = 1 s / b. So the target is not met there, by"
        " construction of the formula the issue requires. It is a smooth, decaying load, not a"
        " herd: "
        f"{_share_range(groups, clients, ('short', 'none'), OURS)} of the clients in the"
        " worst 100 ms, against "
        f"{_share_range(groups, clients, ('short', 'none'), ('openai', 'fixed'))} for the other"
        " two policies. Clients that give up drew three short waits inside the 1 s overload"
        " (3 attempts at most).",
    ]
    lines += ["", "Retries per 100 ms bin from T0 (first 3 s, first repeat):", ""]
    for (scenario, policy), rs in groups.items():
        lines.append(f"- {scenario} / {policy}: `{_histogram(rs[0].arrivals, 2.999)}`")
    lines.append("")
    return "\n".join(lines)


async def _run_all(
    port: int,
    clients: int,
    scenarios: Sequence[str],
    repeats: int,
    names: Sequence[str],
    factories: Mapping[str, PolicyFactory],
    go_program: Path | None,
) -> list[RoundResult]:
    results = []
    for k in range(repeats):
        for i, scenario in enumerate(scenarios):
            for j, policy in enumerate(names):
                seed = 1000 * k + 10 * i + j
                if policy == GO_ARM:
                    assert go_program is not None
                    result = await _go_round(port, scenario, go_program, clients, seed)
                else:
                    result = await _round(port, scenario, policy, factories[policy], clients, seed)
                f, o = result.figures, result.outcome
                print(
                    f"{scenario:>9} {policy:>9}: retries={f.arrivals:5d} peak={f.peak:4d} "
                    f"mean={f.mean:6.1f} ratio={f.ratio:5.2f} (T0 {f.ratio_t0:5.2f}, "
                    f"span {f.ratio_span:5.2f}) window={f.start_s:.2f}-{f.end_s:.2f}s "
                    f"ok={o.succeeded} gave_up={o.gave_up} errors={o.errors}",
                    flush=True,
                )
                results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--policies", nargs="+", choices=arms(), default=None)
    parser.add_argument("--hint-spread", type=float, default=None, help="override HINT_SPREAD")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    factories = policies(args.hint_spread)
    names = [name for name in arms() if not args.policies or name in args.policies]
    if GO_ARM in names and args.hint_spread is not None:
        parser.error(f"--hint-spread applies to the Python SDK only; leave out {GO_ARM}")
    build_dir = tempfile.TemporaryDirectory(prefix="kvgate-retrystorm-")
    go_program = build(RETRY_STORM, Path(build_dir.name)) if GO_ARM in names else None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    # Listening before the child starts: early connections wait in the backlog, not refused.
    sock.listen(4096)
    port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    server = ctx.Process(target=_serve, args=(sock,), daemon=True)
    server.start()
    started = time.monotonic()
    try:
        results: list[RoundResult] = []

        async def go() -> None:
            results.extend(
                await _run_all(
                    port, args.clients, args.scenarios, args.repeats, names, factories, go_program
                )
            )

        _run(go())
    finally:
        server.terminate()
        server.join(timeout=5)
        sock.close()
        build_dir.cleanup()
    report = _report(results, args.clients, args.repeats, time.monotonic() - started)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scraping vLLM's ``/metrics``: parsing one page, and polling a pool's backends.

Parsing uses prometheus-client's text parser. A busy vLLM page is tens of kilobytes of
histograms the scheduler never reads, and the parser is pure Python, so lines are first
*selected* by the names we read (a `str.startswith` over a tuple, done in C) and only those
go through the parser: parsing cost stays flat as vLLM adds metrics.

Names: `vllm:kv_cache_usage_perc` (V1, vLLM >= 0.10) is read first, the V0 name
`vllm:gpu_cache_usage_perc` (removed in 0.12) when the first is absent. Capacity comes from
`vllm:cache_config_info` (`num_gpu_blocks` x `block_size`) when the page has it; a backend's
`capacity_tokens` in the configuration wins over it (an operator's explicit decision). The
decode step time comes from `vllm:inter_token_latency_seconds` (vLLM >= 0.11), or the older
`vllm:time_per_output_token_seconds`: only their `_sum` and `_count`.

Each engine's figures that change as it steps (`EngineFigures`, by the `engine` label of its
samples) are kept for judging a node stuck (scheduler.stuck).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from admission.config import Backend
from admission.failurelog import FailureLog
from scheduler.stuck import StuckWatch

USAGE_V1 = "vllm:kv_cache_usage_perc"
USAGE_V0 = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions"
CACHE_INFO = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
ITL_V1 = "vllm:inter_token_latency_seconds"
ITL_V0 = "vllm:time_per_output_token_seconds"
DEFAULT_BLOCK_SIZE = 16

MAX_PAGE_BYTES = 8 * 1024 * 1024
"""Largest /metrics page read from a node, in bytes as received after any content decoding
(gzip). vLLM's page is tens of kilobytes, a few hundred with many LoRA adapters or one set of
histograms per engine; 8 MiB leaves it more than an order of magnitude of room while bounding
what a broken or hostile node can make the leader buffer (one page per node being scraped),
which the scrape timeout alone does not: a fast network carries hundreds of megabytes within
the default 200 ms."""

SCRAPE_FAILURES = ("timeout", "connect", "parse", "oversized", "error")
"""The `reason` values of a failed scrape (kvgate_scheduler_scrape_errors_total), exported at 0
for every node from the start. The one other reason, `http_<status>` (the node answered with
that status), is an open set and appears with its first occurrence."""

log = logging.getLogger("kvgate.scheduler.scrape")

_NAMES = (USAGE_V1, USAGE_V0, RUNNING, WAITING, PREEMPTIONS, CACHE_INFO, PROMPT_TOKENS,
          GENERATION_TOKENS,
          *(name + part for name in (ITL_V1, ITL_V0) for part in ("_sum", "_count")))
_WANTED = tuple(
    prefix + name for name in _NAMES for prefix in ("", "# HELP ", "# TYPE ")
)


class MetricsError(ValueError):
    """The page answered but lacks what the scheduler needs (no KV usage gauge)."""


class PageTooLarge(Exception):
    """The page is larger than the cap (`MAX_PAGE_BYTES`): declared so, or found so while
    reading it."""


def _charset(response: aiohttp.ClientResponse) -> str:
    # As aiohttp's `text()` decodes: the declared charset, UTF-8 when none or an unknown one.
    with contextlib.suppress(LookupError, ValueError):
        if response.charset:
            return codecs.lookup(response.charset).name
    return "utf-8"


async def read_page(response: aiohttp.ClientResponse, limit: int = MAX_PAGE_BYTES) -> str:
    """The response's body as text, read as it arrives; PageTooLarge (and the connection
    closed) as soon as it passes `limit` bytes, or at once when its Content-Length does.

    What is held is never much more than `limit` (one network read beyond it), however much
    the node sends before the scrape's timeout. A body that is not text in its charset raises
    ValueError (UnicodeDecodeError), as for `ClientResponse.text()`."""
    declared = response.content_length
    if declared is not None and declared > limit:
        response.close()
        raise PageTooLarge(f"/metrics page of {declared} bytes (Content-Length) is over the "
                           f"{limit}-byte cap")
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            # Closed rather than drained: the rest could take as long as the node likes.
            response.close()
            raise PageTooLarge(f"/metrics page is over the {limit}-byte cap")
    return body.decode(_charset(response))


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    kv_usage: float
    """Fraction 0..1 of the KV cache in use."""
    usage_metric: str
    """Which name the usage came from (V1 or V0)."""
    running: int
    waiting: int
    preemptions: float | None
    """vllm:num_preemptions_total, or None when the page lacks it."""
    capacity_tokens: int | None
    """num_gpu_blocks x block_size from cache_config_info, None when absent."""
    block_size: int
    prompt_tokens: float | None = None
    """vllm:prompt_tokens_total (prompt tokens prefilled so far), None when the page lacks it:
    its rate is the node's prefill throughput (scheduler.control)."""
    itl: tuple[float, float] | None = None
    """(sum in seconds, count) of the inter-token latency histogram, None when the page lacks
    it: their rates' ratio is the node's mean decode step time (scheduler.control)."""
    generation_tokens: float | None = None
    """vllm:generation_tokens_total (tokens generated so far), None when the page lacks it."""

    engines: tuple[EngineFigures, ...] = ()
    """Each engine's figures that change as it steps (a data-parallel server has several)."""

    @property
    def shows_decoding(self) -> bool:
        """The page counts decoded tokens: a running sequence moves it at every step."""
        return self.generation_tokens is not None or self.itl is not None



class EngineFigures(NamedTuple):
    """What one engine of a server changes as it steps (module docstring): its samples of the
    usage, the counts, preemptions, prompt and generated tokens, the inter-token histogram's
    count, each summed over its other labels."""

    engine: str
    """The `engine` label ("" on a page without one)."""
    busy: bool
    """It reports requests running or waiting."""
    figures: tuple[tuple[str, float], ...]


_PROGRESS = frozenset((USAGE_V1, USAGE_V0, RUNNING, WAITING, PREEMPTIONS, PREEMPTIONS + "_total",
                       PROMPT_TOKENS + "_total", GENERATION_TOKENS + "_total", ITL_V1 + "_count",
                       ITL_V0 + "_count"))


def _engines(per_engine: dict[str, dict[str, float]]) -> tuple[EngineFigures, ...]:
    # A figure that is not finite is left out: NaN never equals the next reading's NaN, and
    # would read as a change at every scrape.
    return tuple(EngineFigures(label, values.get(RUNNING, 0.0) + values.get(WAITING, 0.0) > 0,
                               tuple(sorted((k, v) for k, v in values.items()
                                            if math.isfinite(v))))
                 for label, values in sorted(per_engine.items()))


def _select(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith(_WANTED)) + "\n"


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(labels[name])
    except (KeyError, ValueError):
        return None


def parse_vllm_metrics(text: str) -> NodeMetrics:
    """Read what the scheduler needs from one vLLM /metrics page; raises MetricsError."""
    usage: dict[str, list[float]] = {USAGE_V1: [], USAGE_V0: []}
    running = waiting = 0.0
    counted: set[str] = set()
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    itl: dict[str, list[float]] = {ITL_V1: [0.0, 0.0], ITL_V0: [0.0, 0.0]}
    seen_itl: dict[str, set[str]] = {ITL_V1: set(), ITL_V0: set()}
    capacity = 0
    block_size: int | None = None
    per_engine: dict[str, dict[str, float]] = {}
    try:
        families = list(text_string_to_metric_families(_select(text)))
    except ValueError as exc:
        raise MetricsError(f"unparsable metrics: {exc}") from None
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name in _PROGRESS:
                figures = per_engine.setdefault(sample.labels.get("engine", ""), {})
                figures[name] = figures.get(name, 0.0) + sample.value
            if name in usage:
                usage[name].append(sample.value)
            elif name == RUNNING:
                running += sample.value
                counted.add(name)
            elif name == WAITING:
                waiting += sample.value
                counted.add(name)
            elif name in (PREEMPTIONS + "_total", PREEMPTIONS):
                preemptions = (preemptions or 0.0) + sample.value
            elif name == PROMPT_TOKENS + "_total":
                prompt_tokens = (prompt_tokens or 0.0) + sample.value
            elif name == GENERATION_TOKENS + "_total":
                generation_tokens = (generation_tokens or 0.0) + sample.value
            elif name.rpartition("_")[0] in itl:
                # Only the _sum and _count lines are selected (not the buckets): summed over
                # engines, the ratio of their rates is the mean over every decoded token.
                base, _, part = name.rpartition("_")
                itl[base][part == "count"] += sample.value
                seen_itl[base].add(part)
            elif name == CACHE_INFO:
                blocks = _int_label(sample.labels, "num_gpu_blocks")
                size = _int_label(sample.labels, "block_size")
                if blocks is not None and size is not None and blocks > 0 and size > 0:
                    capacity += blocks * size
                    block_size = size
    metric = USAGE_V1 if usage[USAGE_V1] else USAGE_V0
    if not usage[metric]:
        raise MetricsError(f"neither {USAGE_V1} nor {USAGE_V0} on the page")
    # Every engine's figure is checked, not only the highest: max() keeps whichever of a
    # number and NaN comes first, so an engine reading NaN (or -Inf) listed after a finite one
    # was silently left out of the usage, and the same page was refused in the other order.
    kv = next((v for v in usage[metric] if not math.isfinite(v)), max(usage[metric]))
    # NaN: an engine that has not reported yet. The counts size the projection's padding and
    # the running limit: a reading without them is no reading (int() of NaN raised out of the
    # scrape, which then never counted as failed and the node was never ejected; a page
    # without the counts at all read as an idle node, and the limit released into it).
    for name in (RUNNING, WAITING):
        if name not in counted:
            raise MetricsError(f"{name} is not on the page")
    for name, value in ((metric, kv), (RUNNING, running), (WAITING, waiting)):
        if not math.isfinite(value):
            raise MetricsError(f"{name} is {value}")
    # Both parts or none: a _count without its _sum read as a sum of 0, a step time of 0 s
    # that the running limit and a lane's cap divide by (a ZeroDivisionError out of the tick
    # ended the pool's loop). A histogram missing a part is read as absent, like a counter
    # that is not finite.
    step = next(((itl[n][0], itl[n][1]) for n in (ITL_V1, ITL_V0)
                 if seen_itl[n] == {"sum", "count"}), None)
    return NodeMetrics(
        kv_usage=min(1.0, max(0.0, kv)),
        usage_metric=metric,
        running=max(0, int(running)),
        waiting=max(0, int(waiting)),
        # A counter that is not a finite number is left out, as if the page lacked it: NaN
        # compares false with everything, so a NaN preemption count once stored hid every
        # later preemption of the node.
        preemptions=_finite(preemptions),
        capacity_tokens=capacity or None,
        block_size=block_size or DEFAULT_BLOCK_SIZE,
        prompt_tokens=_finite(prompt_tokens),
        itl=step if step is not None and all(map(math.isfinite, step)) else None,
        generation_tokens=_finite(generation_tokens),
        engines=_engines(per_engine),
    )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(slots=True)
class NodeState:
    """What the poller knows about one backend across polls."""

    backend: Backend
    metrics: NodeMetrics | None = None
    ok_at: float = 0.0
    """Monotonic time of the last successful scrape."""
    failures: int = 0
    """Failed scrapes in a row; reset by one success."""
    last_error: str = ""
    seq: int = 0
    """Successful scrapes so far: a new value means a new reading."""
    inflight: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def capacity(self) -> int | None:
        if self.backend.capacity_tokens is not None:
            return self.backend.capacity_tokens
        return self.metrics.capacity_tokens if self.metrics else None


@dataclass(frozen=True, slots=True)
class NodeView:
    """One backend as one tick sees it."""

    name: str
    metrics: NodeMetrics | None
    capacity: int | None
    stale: bool
    """The newest scrape failed or is overdue: the stale policy applies."""
    ejected: bool
    """Failed `eject_after` scrapes in a row, or stuck: no work goes to it until it answers
    again, or changes."""
    age_s: float
    seq: int
    """Number of the reading (see NodeState.seq)."""
    error: str
    still_s: float = 0.0
    """How long its stillest engine that holds requests has not changed its figures, to the
    last good reading (scheduler.stuck)."""
    stuck: bool = False
    """Judged stuck (scheduler.stuck): ejected until its still engines change."""
    frozen_s: float = 0.0
    """How long none of its page has changed, to the last good reading (scheduler.stuck)."""
    frozen: bool = False
    """Judged stuck as a frozen page (scheduler.stuck): a request sent after the page's last
    change left no trace on it; ejected until the page changes."""


ScrapeHook = Callable[[str, float, str | None], None]
"""Called after every scrape with (node, seconds taken, error reason or None)."""


class Poller:
    """Scrapes every backend of one pool concurrently; at most one scrape per backend in flight.

    `poll()` starts a scrape for each backend that has none running and waits for them at most
    `wait_s`: a slow backend's scrape goes on (until `timeout_s`) while the tick proceeds with its
    previous reading marked stale, so one hung server cannot delay releases to the others.
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        stale_after_s: float,
        eject_after: int,
        stuck_after_s: float = 0.0,
        on_scrape: ScrapeHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        pool: str = "",
        max_page_bytes: int = MAX_PAGE_BYTES,
    ) -> None:
        self.pool = pool
        """The pool's name, for log lines (a replica polls several pools' nodes)."""
        self.nodes = [NodeState(b) for b in backends]
        self.max_page_bytes = max_page_bytes
        # An oversized page fails every scrape (20 a second by default): one line per streak.
        self._oversized = {
            b.name: FailureLog(f"pool {pool}: node {b.name} scrape", clock, log,
                               recovered=f"pool {pool}: node {b.name} /metrics page fits again")
            for b in backends}
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.stale_after_s = stale_after_s
        self.eject_after = eject_after
        self.stuck_watch = StuckWatch(stuck_after_s)
        self.on_scrape = on_scrape
        self.clock = clock

    async def _scrape(self, node: NodeState) -> None:
        started = self.clock()
        error: str | None = None
        try:
            async with self.session.get(
                node.backend.url + "/metrics", timeout=self.timeout
            ) as response:
                if response.status != 200:
                    error = f"http_{response.status}"
                else:
                    page = await read_page(response, self.max_page_bytes)
                    node.metrics = parse_vllm_metrics(page)
        except TimeoutError:
            error = "timeout"
        except aiohttp.ClientError:
            error = "connect"
        except PageTooLarge as exc:
            error = "oversized"
            self._oversized[node.name].failed(exc)
        except ValueError:  # MetricsError, or a body that is not text in its charset
            error = "parse"
        except Exception as exc:
            # Whatever else fails is still a failed scrape: raised out of this task it was
            # never counted (the node never ejected) and asyncio logged it on every poll.
            error = "error"
            if node.last_error != error:
                log.warning("pool %s: node %s: scrape failed: %r", self.pool, node.name, exc)
        if error is None:
            node.failures, node.ok_at, node.last_error = 0, self.clock(), ""
            node.seq += 1
            if node.metrics is not None:
                self.stuck_watch.reading(node.name, node.metrics, node.ok_at)
            self._oversized[node.name].succeeded()
        else:
            node.failures += 1
            node.last_error = error
        if self.on_scrape is not None:
            self.on_scrape(node.name, self.clock() - started, error)

    def forget(self) -> None:
        """Forget every reading (a new leadership starts): a standby's last readings may be
        hours old, and read as the node's state they would set a zone and budgets, and reach
        the release control as a reading it has not seen. The readings' numbering goes on,
        so that the next one is new to whoever saw the last."""
        for node in self.nodes:
            node.metrics, node.ok_at, node.failures, node.last_error = None, 0.0, 0, ""
        self.stuck_watch.forget()

    async def poll(self, wait_s: float) -> list[NodeView]:
        for node in self.nodes:
            if node.inflight is None or node.inflight.done():
                node.inflight = asyncio.create_task(self._scrape(node))
        pending = [n.inflight for n in self.nodes if n.inflight is not None]
        if pending:
            await asyncio.wait(pending, timeout=wait_s)
        return [self.view(node) for node in self.nodes]

    def view(self, node: NodeState) -> NodeView:
        now = self.clock()
        m = node.metrics
        age = now - node.ok_at if m is not None else float("inf")
        still = self.stuck_watch.still_s(node.name, m, node.ok_at)
        stuck = self.stuck_watch.stuck(node.name, still)
        frozen_s = self.stuck_watch.frozen_s(node.name, m, node.ok_at)
        return NodeView(
            name=node.name,
            metrics=m,
            capacity=node.capacity,
            stale=m is None or node.failures > 0 or age > self.stale_after_s,
            ejected=node.failures >= self.eject_after or stuck,
            age_s=age,
            seq=node.seq,
            error=node.last_error,
            still_s=still,
            stuck=stuck,
            frozen_s=frozen_s,
            frozen=self.stuck_watch.frozen(node.name),
        )

    async def judge_stuck(
        self, views: list[NodeView],
        aged: Callable[[set[str], float], Awaitable[dict[str, float]]],
        hung: Callable[[NodeView, float], bool | None] | None = None,
    ) -> list[NodeView]:
        """`views` with the candidates for stuck judged (scheduler.stuck): `aged(nodes, age_s)`
        reads, for those of `nodes` holding a task released `age_s` ago or more, the latest
        such release (monotonic, this process's clock); read only if there is a candidate.
        For the busy rule `age_s` is `stuck_after_ms`; for a frozen page, `stuck_after_ms`
        plus the age of the oldest frozen candidate's last good reading (never stale, so at
        most the stale bound): it is judged on a reading taken `stuck_after_ms` after the
        release, not on the task's age alone. `hung(view, since)` (scheduler.probe
        `Prober.hung`), if given, confirms a frozen page: whether a probe sent at `since` (the
        release) or later went unanswered (None: not known yet)."""
        watch = self.stuck_watch
        busy = {v.name for v in views if watch.candidate(v.name, v.still_s)}
        # A frozen page is judged on readings taken after the release: none while stale.
        frozen = {v.name for v in views
                  if not v.stale and watch.frozen_candidate(v.name, v.frozen_s)}
        if not busy and not frozen:
            return views
        nodes = {n.name: n for n in self.nodes}
        by_name = {v.name: v for v in views}
        judged: set[str] = set()
        # Each rule reads, then looks again: a scrape that ended during the read may show the
        # node moving again.
        if busy:
            held = await aged(busy, watch.after_s)
            for name in busy & held.keys():
                node = nodes[name]
                if watch.candidate(name, watch.still_s(name, node.metrics, node.ok_at)):
                    watch.judge(name)
                    judged.add(name)
        frozen -= judged
        if frozen:
            lag = max(self.clock() - nodes[name].ok_at for name in frozen)
            frozen_held = await aged(frozen, watch.after_s + max(lag, 0.0))
            for name in frozen & frozen_held.keys():
                node = nodes[name]
                if not watch.frozen_candidate(
                        name, watch.frozen_s(name, node.metrics, node.ok_at)):
                    continue
                released = watch.frozen_release(name, frozen_held[name])
                # A probe sent after the release: while requests keep coming, the latest
                # release moves on, and a probe must not have to outlast them.
                if released is None or (hung is not None
                                        and not hung(by_name[name], released)):
                    continue
                watch.judge_frozen(name)
                judged.add(name)
        return [dataclasses.replace(v, stuck=True, ejected=True, frozen=watch.frozen(v.name))
                if v.name in judged else v for v in views]

    async def close(self) -> None:
        tasks = [n.inflight for n in self.nodes if n.inflight is not None and not n.inflight.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

"""The Go SDK (clients/go) against the real gateway: its example program, built with `go build`,
runs as a child process against the gateway of tests/gateway_harness.py (the session's
redis-server, an instant vLLM-like backend, all on real sockets), while the test plays the
scheduler and holds the pool in RED, then turns it GREEN (or holds it YELLOW, where Batch
requests queue and are never released).

Nothing is injected into the Go process: it sleeps on the real clock. Its `-trace` lines say
when each attempt was sent and answered (its own monotonic clock) and with which headers; the
gateway's metrics count the attempts independently.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.tiers import Zone
from bench.common.golang import CHAT_EXAMPLE, GoMissing, build
from gateway.handlers import client_deadline_ms
from gateway.parse import whole_answer_s
from tests.gateway_harness import (
    BIG,
    KEYS,
    POOL,
    Harness,
    eventually,
    queued_tokens_tenant,
    running_gateway,
)

# RED with the normal tier draining at 1 task/s and nothing queued: the gateway's hint is
# (0 + 1) / 1 = 1 s, spread upward by its retry_jitter (25%). The Go client then waits
# uniformly on [h, h + max(1 s, h)]: between 1 and 2.5 s.
RED_DRAIN = 1.0
RED_HINT_MS = 1000
GATEWAY_JITTER = 1.25
RUN_TIMEOUT_S = 90.0


@pytest.fixture(scope="session")
def chat_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build(CHAT_EXAMPLE, tmp_path_factory.mktemp("go"))
    except GoMissing as exc:
        pytest.skip(f"{exc} (make test installs Debian's golang-go)")


@pytest.fixture
async def gw(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[Harness]:
    async with running_gateway(redis_url) as harness:
        yield harness


async def hold_red(gw: Harness) -> None:
    await gw.publish(Zone.RED, capacity=0, extra={"drain_0": 0, "drain_1": RED_DRAIN, "drain_2": 0})


def rejections(gw: Harness, reason: str = "zone_red") -> int:
    value = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_rejections_total", {"pool": POOL, "tier": "normal", "reason": reason}
    )
    return int(value or 0)


def tokens(n: int) -> str:
    """What the instant backend generates: ' t0 t1 ...'."""
    return "".join(f" t{i}" for i in range(n))


class Run:
    """One run of the example: exit code, stdout, and its -trace lines parsed."""

    def __init__(self, code: int, out: bytes, err: bytes) -> None:
        self.code = code
        self.stdout = out.decode()
        self.lines: list[dict[str, Any]] = []
        self.other: list[str] = []
        for line in err.decode().splitlines():
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.other.append(line)

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["event"] == "attempt"]

    @property
    def stats(self) -> dict[str, Any]:
        [line] = [line for line in self.lines if line["event"] == "stats"]
        stats: dict[str, Any] = line["stats"]
        return stats


async def start(binary: Path, gw: Harness, *args: str, who: str = "normal"
                ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(binary), "-base-url", gw.url + "/v1", "-api-key", KEYS[who], "-model", "demo",
        "-trace", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def finish(proc: asyncio.subprocess.Process) -> Run:
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    run = Run(proc.returncode if proc.returncode is not None else -1, out, err)
    sys.stderr.write("".join(f"go: {line}\n" for line in run.other))
    return run


@pytest.mark.parametrize(
    "mode",
    [["-stream"], [], ["-stream", "-completions"]],
    ids=["chat-stream", "chat", "completions-stream"],
)
async def test_go_client_waits_out_red_then_succeeds(
    gw: Harness, chat_example: Path, mode: list[str]
) -> None:
    await hold_red(gw)
    proc = await start(chat_example, gw, "-max-tokens", "4", *mode)
    # The scheduler turns the pool GREEN once the first attempt has been refused: the client's
    # wait (at least the 1 s hint) leaves ample time.
    await eventually(lambda: _rejected_or_exited(gw, proc), within_s=RUN_TIMEOUT_S)
    await gw.publish(Zone.GREEN)
    run = await finish(proc)

    assert run.code == 0, run.other
    assert run.stdout.strip("\n") == tokens(4)
    first, second = run.attempts  # exactly one retry
    assert (first["retry_count"], first["status"]) == ("", 429)
    assert (second["retry_count"], second["status"]) == ("1", 200)
    # The 429 protocol as the Go client received it.
    hint_ms = int(first["retry_after_ms"])
    assert RED_HINT_MS <= hint_ms <= RED_HINT_MS * GATEWAY_JITTER
    assert int(first["retry_after"]) == math.ceil(hint_ms / 1000)
    assert first["level"] == "RED" and int(first["queue_depth"]) >= 0
    # It waited at least the gateway's hint (retry-after-ms, the precise value, read first),
    # and no longer than the policy's window above it allows (plus 1 s of scheduling slack).
    waited = second["sent_s"] - first["answered_s"]
    hint_s = hint_ms / 1000
    assert hint_s <= waited <= hint_s + max(1.0, hint_s) + 1.0
    stats = run.stats
    assert (stats["requests"], stats["attempts"], stats["retries"]) == (1, 2, 1)
    assert stats["outcomes"] == {"ok": 1}
    # Counted by the gateway too: one refusal in RED, and the retry reached the backend
    # marked as such.
    assert rejections(gw) == 1
    [forwarded] = gw.backends[0].received
    headers = {k.lower(): v for k, v in forwarded.headers.items()}
    assert headers["x-kvgate-retry-count"] == "1"
    assert forwarded.body["stream"] is ("-stream" in mode)


async def _rejected_or_exited(gw: Harness, proc: asyncio.subprocess.Process) -> bool:
    # A program that ended early (it should not) is reported by the assertions below at once.
    return rejections(gw) >= 1 or proc.returncode is not None


async def test_go_client_reports_the_429_protocol_when_it_gives_up(
    gw: Harness, chat_example: Path
) -> None:
    await hold_red(gw)
    # An empty budget: the first 429 is final, and the RateLimitError reaches the program.
    run = await finish(await start(chat_example, gw, "-budget-initial", "0"))
    assert run.code == 1
    [attempt] = run.attempts
    [message] = run.other
    assert message.startswith("rate limited: code=capacity_exceeded ")
    assert f"retry_after_ms={int(attempt['retry_after_ms'])} " in message
    assert f"level=RED queue_depth={int(attempt['queue_depth'])}" in message
    assert run.stats["outcomes"] == {"budget": 1}
    assert rejections(gw) == 1


REQUESTS = 300
WORKERS = 30


@pytest.mark.parametrize("initial", [0.0, 10.0], ids=["empty", "default-full"])
async def test_go_client_attempts_stay_within_1_1x_under_sustained_429s(
    gw: Harness, chat_example: Path, initial: float
) -> None:
    await hold_red(gw)
    run = await finish(
        await start(
            chat_example, gw, "-n", str(REQUESTS), "-concurrency", str(WORKERS),
            "-max-tokens", "8", "-budget-initial", str(initial),
        )
    )
    assert run.code == 0, run.other
    assert json.loads(run.stdout) == {
        "requests": REQUESTS, "ok": 0, "rate_limited": REQUESTS, "other_errors": 0}
    attempts = rejections(gw)  # counted by the gateway: every attempt was refused
    stats = run.stats
    assert attempts == stats["attempts"] == len(run.attempts)  # and the client agrees
    # Each request earns 0.1 retry, plus what the bucket held at the start: with it empty,
    # 1.1x exactly; full (the default), 1.1x plus at most 10 attempts in all.
    assert attempts <= 1.1 * REQUESTS + initial
    # Retries did happen, and the budget stopped the others (the policy alone allows 3
    # attempts per request).
    assert attempts >= REQUESTS * 1.1 - 1
    assert set(stats["outcomes"]) <= {"budget", "max_attempts"}
    assert stats["budget"]["retries_denied"] >= REQUESTS - (attempts - REQUESTS)


GO_TIMEOUT_S = 3.0
GO_MAX_TOKENS = 8


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_go_client_gets_its_429_and_hint_before_its_context_ends(
    gw: Harness, chat_example: Path, stream: bool
) -> None:
    """The harness's Batch tier waits 20 s in the queue; the program's context, 3 s. Each
    attempt declares the context's time left, and the gateway's 429 arrives while the program
    still listens: 0.5 s (or a tenth) before it, and for a whole answer earlier still by the
    time the answer may take to generate."""
    await gw.publish(Zone.YELLOW, capacity=BIG, extra={"drain_2": 0})  # Batch queues for ever
    run = await finish(await start(
        chat_example, gw, "-timeout", f"{GO_TIMEOUT_S}s", "-max-tokens", str(GO_MAX_TOKENS),
        *(["-stream"] if stream else []), who="batch"))
    assert run.code == 1
    [attempt] = run.attempts
    [message] = run.other
    assert message.startswith("rate limited: code=capacity_exceeded "), message
    assert attempt["status"] == 429 and int(attempt["retry_after_ms"]) >= 1
    declared = float(attempt["read_timeout"])
    assert GO_TIMEOUT_S - 0.5 < declared <= GO_TIMEOUT_S, declared  # the time left, raw
    generation_s = whole_answer_s(stream, GO_MAX_TOKENS,
                                  gw.config.gateway.upstream_ms_per_output_token / 1000)
    deadline_ms = client_deadline_ms(None, attempt["read_timeout"], generation_s=generation_s)
    stream_deadline_ms = client_deadline_ms(None, attempt["read_timeout"])
    assert deadline_ms is not None and stream_deadline_ms is not None
    assert (deadline_ms < stream_deadline_ms) is not stream  # a whole answer's comes sooner
    held_s = attempt["answered_s"] - attempt["sent_s"]
    assert deadline_ms / 1000 <= held_s < deadline_ms / 1000 + 0.5, held_s  # held until then ...
    assert attempt["answered_s"] < GO_TIMEOUT_S  # ... and answered before the context ended
    # The hint (the 60 s cap: nothing drains) reaches past the context's deadline: no retry,
    # the 429 is the answer.
    assert run.stats["outcomes"] == {"deadline": 1}
    value = gw.gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_requests_total",
        {"pool": POOL, "tier": "batch", "outcome": "queue_timeout"})
    assert value == 1


async def test_go_client_reads_the_scope_of_a_tenants_cap_on_queued_tokens(
    redis_url: str, redis_client: aioredis.Redis, chat_example: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adjust = queued_tokens_tenant(monkeypatch)

    async with running_gateway(redis_url, adjust=adjust) as gw:
        await gw.publish(Zone.YELLOW)  # Normal never takes the fast path: everything queues
        client = gw.openai("flood")
        queued = [asyncio.create_task(client.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": "hi"}], max_tokens=300))
            for _ in range(3)]  # ~3 x 310 tokens of the 1,000

        async def three_queued() -> bool:
            return await gw.queued(1) == 3

        await eventually(three_queued)
        run = await finish(await start(chat_example, gw, "-max-tokens", "300",
                                       "-budget-initial", "0", who="flood"))
        await gw.release((0, 10, 0))
        await asyncio.gather(*queued)
    assert run.code == 1
    [attempt] = run.attempts
    [message] = run.other
    assert message.startswith("rate limited: code=rate_limit_exceeded_queued_tokens ")
    assert f"retry_after_ms={int(attempt['retry_after_ms'])} " in message
    assert "level=YELLOW queue_depth=3 scope=key: " in message

"""Pieces of the gateway on their own: SSE relay, usage meter, retry hints, tenant lookup."""

from __future__ import annotations

import hashlib
import os
import random

import orjson
import pytest

from admission.config import TenantSettings
from admission.tiers import Tier
from gateway.auth import TenantDirectory, effective_tier
from gateway.errors import MAX_RETRY_MS, ApiError, jittered, retry_headers
from gateway.handlers import client_deadline_ms
from gateway.parse import whole_answer_s
from gateway.relay import Meter, Phase, SseRelay


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _token(text: str, finish: str | None = None) -> bytes:
    return _event({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


ROLE = _event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]})
USAGE = _event({"id": "c", "choices": [],
                "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + _token("a") + _token("b") + _token("", "stop") + USAGE + DONE


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("piece", [1, 2, 7, 64, len(STREAM)])
def test_sse_relay_at_any_split(strip: bool, piece: int) -> None:
    meter = Meter(prompt_tokens=11)
    relay = SseRelay(meter, strip_usage=strip)
    out = b"".join(relay.feed(STREAM[i:i + piece]) for i in range(0, len(STREAM), piece))
    out += relay.flush()
    assert out == (STREAM.replace(USAGE, b"") if strip else STREAM)
    assert meter.exact_total == 14 and meter.completion_tokens == 3


def test_sse_relay_counts_tokens_of_a_stream_cut_short() -> None:
    meter = Meter(prompt_tokens=11)
    relay = SseRelay(meter, strip_usage=True)
    sent = relay.feed(ROLE + _token("a") + _token("b") + b"data: {\"partial")
    assert sent == ROLE + _token("a") + _token("b")  # the incomplete event waits
    meter.phase = Phase.SENT
    assert meter.finish_args() == (11 + 2, True)  # prompt + tokens seen, task cancelled


def test_a_stream_cut_short_counts_its_reasoning_tokens_under_either_name() -> None:
    """vLLM named a reasoning model's thinking `reasoning_content`, and `reasoning` since
    early 2026: a client that left before the usage chunk paid nothing for the new name's."""
    for field in ("reasoning", "reasoning_content"):
        meter = Meter(prompt_tokens=11)
        relay = SseRelay(meter, strip_usage=True)
        thinking = _event({"id": "c", "choices": [
            {"index": 0, "delta": {field: "hm"}, "finish_reason": None}]})
        relay.feed(ROLE + thinking * 3 + _token("a"))
        meter.phase = Phase.SENT
        assert meter.finish_args() == (11 + 4, True), field


def test_sse_relay_passes_unusual_events_through() -> None:
    relay = SseRelay(Meter(1), strip_usage=True)
    odd = b": keep-alive\n\nevent: x\ndata: not json\n\ndata: [1, 2]\n\n"
    assert relay.feed(odd) == odd


def test_meter_outcomes() -> None:
    assert Meter(5).finish_args() == (None, True)  # never reached a node: full refund
    done = Meter(5, completion_tokens=2, phase=Phase.DONE)
    assert done.finish_args() == (7, False)
    exact = Meter(5, phase=Phase.DONE)
    exact.take_usage({"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10})
    assert exact.finish_args() == (10, False)


def test_jitter_spreads_upward_within_bounds() -> None:
    rng = random.Random(7)
    hints = [jittered(4000, 0.25, rng) for _ in range(2000)]
    assert min(hints) >= 4000 and max(hints) <= 5000
    assert len(set(hints)) > 500  # actually spread
    # At the cap the spread is kept below it rather than clamped into one value.
    capped = [jittered(10 * MAX_RETRY_MS, 0.25, rng) for _ in range(500)]
    assert min(capped) >= MAX_RETRY_MS / 1.25 and max(capped) <= MAX_RETRY_MS
    assert len(set(capped)) > 300
    # A quota's exact refill time is not capped, and still only spread upward.
    uncapped = [jittered(10 * MAX_RETRY_MS, 0.25, rng, cap=None) for _ in range(200)]
    # ...spread by a quarter of a minute at most, not a quarter of the wait.
    assert min(uncapped) >= 10 * MAX_RETRY_MS and max(uncapped) <= 10.25 * MAX_RETRY_MS
    assert len(set(uncapped)) > 100
    assert jittered(0, 0.25, rng) >= 1


def test_retry_headers_round_seconds_up() -> None:
    assert retry_headers(3500) == {"Retry-After": "4", "retry-after-ms": "3500"}
    assert retry_headers(1) == {"Retry-After": "1", "retry-after-ms": "1"}
    assert retry_headers(2000)["Retry-After"] == "2"
    error = ApiError(429, "x", code="capacity_exceeded", retry_after_ms=1500)
    assert error.body()["error"] == {"message": "x", "type": "rate_limit_error", "param": None,
                                     "code": "capacity_exceeded", "retry_after_ms": 1500}


def _tenant(name: str, tier: Tier, key: str) -> TenantSettings:
    return TenantSettings(name, tier, (hashlib.sha256(key.encode()).hexdigest(),), 1, 1, 1)


def test_tenant_directory_and_priority_lowering() -> None:
    alice, bob = _tenant("alice", Tier.NORMAL, "sk-a"), _tenant("bob", Tier.VIP, "sk-b")
    directory = TenantDirectory([alice, bob])
    assert directory.authenticate("Bearer sk-a") is alice
    assert directory.authenticate("bearer  sk-b ") is bob
    for bad in (None, "", "Bearer", "Basic sk-a", "Bearer sk-c", "sk-a"):
        with pytest.raises(ApiError) as info:
            directory.authenticate(bad)
        assert info.value.status == 401
    assert effective_tier(alice, None) is Tier.NORMAL
    assert effective_tier(alice, "batch") is Tier.BATCH
    assert effective_tier(alice, "2") is Tier.BATCH
    assert effective_tier(alice, "vip") is Tier.NORMAL  # never raised
    assert effective_tier(bob, "NORMAL") is Tier.NORMAL
    with pytest.raises(ApiError):
        effective_tier(alice, "urgent")


def test_task_ids_are_unique_hex_and_not_shared_with_a_forked_child() -> None:
    from gateway.admit import new_task_id

    ids = [new_task_id() for _ in range(5000)]  # spans several 4 KB blocks
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write_end, ",".join(new_task_id() for _ in range(100)).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as pipe:
        from_child = pipe.read().decode().split(",")
    from_parent = [new_task_id() for _ in range(100)]
    assert len(from_child) == 100
    assert not set(from_child) & set(from_parent)


def test_a_clients_deadline_is_the_shorter_of_its_header_and_its_sdks_read_timeout() -> None:
    assert client_deadline_ms(None, None) is None
    assert client_deadline_ms("1.5", None) == 1500
    # An SDK's read timeout leaves a margin for the 429's way back: 0.5 s, or a tenth of it.
    assert client_deadline_ms(None, "3") == 2500
    assert client_deadline_ms(None, "600") == 540_000  # the SDK's default
    assert client_deadline_ms(None, "0.6") == 300  # at least half of it
    assert client_deadline_ms("1", "600") == 1000
    assert client_deadline_ms("900", "600") == 540_000
    # Not ours to refuse: an SDK header that is not a positive number is ignored...
    for odd in ("abc", "-1", "0", "nan", "inf", ""):
        assert client_deadline_ms(None, odd) is None, odd
    assert client_deadline_ms(None, "1e308") == 900_000_000_000  # capped as the header's is
    # ...while our own header still is refused.
    with pytest.raises(ApiError) as info:
        client_deadline_ms("abc", "600")
    assert info.value.status == 400


def test_a_whole_answers_generation_comes_off_the_sdks_read_timeout() -> None:
    """A non-streamed answer's first byte comes when it is complete: the queue leaves it the
    time it may take, down to half the read timeout; `X-Request-Timeout` is the queue's wait
    as stated."""
    assert client_deadline_ms(None, "600", generation_s=100) == 440_000
    assert client_deadline_ms(None, "600", generation_s=10_000) == 300_000
    assert client_deadline_ms("400", "600", generation_s=100) == 400_000
    assert client_deadline_ms("400", None, generation_s=10_000) == 400_000
    assert whole_answer_s(True, 1_000, 0.1) == 0
    assert whole_answer_s(False, 1_000, 0.1) == pytest.approx(100)


def test_a_usage_with_only_its_total_is_the_nodes_count() -> None:
    """A node whose usage has `total_tokens` alone: charged that, not the reservation."""
    meter = Meter(prompt_tokens=11)
    meter.take_usage({"total_tokens": 40})
    meter.phase = Phase.DONE
    assert meter.finish_args() == (40, False)

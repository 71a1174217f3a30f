"""Placement among nodes with (nearly) the same headroom: equal nodes share the load.

`place()` in lua/_place.lua picks the node with the most headroom; nodes whose headroom is less
than the task's cost or a 32nd of the best's below it tie, and a tie goes to the least
reserved, then in turn by the pool's release count (`stats` released_0..2). The property test
checks the script's choice against the reference model (tests/model.py); the integration test
sends short requests through two real gateways to two idle backends and counts what each
backend received.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.config import parse_config
from admission.outcomes import AdmitOutcome
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore, TenantQuota
from admission.tiers import Tier, Zone
from bench.common.instant_backend import InstantBackend
from gateway.app import create_app
from gateway.state import GATEWAY
from tests.gateway_harness import KEYS, POOL, config_data, serve_backend
from tests.model import Model
from tests.properties import PROPERTIES, examples

NODES = ("node-a", "node-b", "node-c")
TENANT = TenantQuota("t", rate=0, burst=10**9, max_queued=100)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@pytest.fixture(scope="module")
def place_loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@settings(PROPERTIES, max_examples=examples(300),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(caps=st.dictionaries(st.sampled_from(NODES),
                            st.one_of(st.sampled_from([0, 500, 1_000]), st.integers(0, 1_200)),
                            min_size=1),
       reserved=st.dictionaries(st.sampled_from(NODES), st.sampled_from([1, 50, 100, 300, 499]),
                                max_size=3),
       released_before=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)),
       tier=st.sampled_from(list(Tier)), prompt=st.integers(1, 200),
       out=st.integers(0, 200), batch_below=st.sampled_from([0, 0, 100]))
def test_the_scripts_choice_among_near_ties_is_the_models(
        redis_url: str, place_loop: asyncio.AbstractEventLoop, caps: dict[str, int],
        reserved: dict[str, int], released_before: tuple[int, int, int], tier: Tier,
        prompt: int, out: int, batch_below: int) -> None:
    """One admit on the fast path against a pool in a given state: same node as the model's
    `place` (or both none), with the same count of earlier releases."""
    reserved = {n: r for n, r in reserved.items() if n in caps}
    # Batch's ceiling below the others' by `batch_below` tokens on every node.
    tiers = {n: (c, c, max(0, c - batch_below)) for n, c in caps.items()}
    model = Model(now=0, tier_caps=(10, 10, 10), lease_ttl_ms=10_000, stale_after_ms=0,
                  default_retry_ms=1_000)
    model.publish_state(1, "GREEN", tiers, (0, 0, 0))
    model.reserved = dict(reserved)
    model.released_count = sum(released_before)
    expected, _ = model.place(int(tier), prompt + out, prompt)

    async def scripts_choice() -> str | None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.flushdb()
            store = PoolStore(client, register_scripts(client), "ties", PoolPolicy())
            await store.publish_state(1, Zone.GREEN, tiers)
            k = store.keys
            if reserved:
                await client.hset(k.node_reserved, mapping=dict(reserved.items()))
            await client.hset(k.stats, mapping={f"released_{t}": n
                                                for t, n in enumerate(released_before)})
            got = await store.admit(task_id="x", tenant=TENANT, tier=tier, prompt_tokens=prompt,
                                    max_tokens=out, gateway="gw", queue_timeout_ms=1_000)
            return got.node if got.outcome is AdmitOutcome.RELEASED else None
        finally:
            await client.aclose()

    assert place_loop.run_until_complete(scripts_choice()) == expected


async def test_equal_idle_nodes_take_turns_on_the_fast_path(redis_client: aioredis.Redis) -> None:
    """Back-to-back admits that each end before the next: every one finds both nodes idle."""
    store = PoolStore(redis_client, register_scripts(redis_client), "ties", PoolPolicy())
    await store.publish_state(1, Zone.GREEN, {"node-a": 1_000, "node-b": 1_000})
    nodes = []
    for i in range(6):
        got = await store.admit(task_id=f"t{i}", tenant=TENANT, tier=Tier.NORMAL,
                                prompt_tokens=10, max_tokens=10, gateway="gw",
                                queue_timeout_ms=1_000)
        nodes.append(got.node)
        await store.settle(f"t{i}", 15)
    assert nodes == ["node-a", "node-b"] * 3


@pytest.mark.parametrize(("caps", "cost", "turns"), [
    # 99 tokens apart, under a 32nd of the best's 3,299: a tie even for a 20-token task.
    pytest.param({"node-a": 3_200, "node-b": 3_299}, 20, True, id="within-a-32nd"),
    # 200 apart, more than a 32nd (106) and than the task: the most headroom wins.
    pytest.param({"node-a": 3_200, "node-b": 3_400}, 20, False, id="beyond-a-32nd"),
    # 40 apart, more than a 32nd of 360 (11): a tie for a 50-token task, not a 30-token one.
    pytest.param({"node-a": 320, "node-b": 360}, 50, True, id="within-the-cost"),
    pytest.param({"node-a": 320, "node-b": 360}, 30, False, id="beyond-the-cost"),
])
async def test_nearly_equal_idle_nodes_tie(redis_client: aioredis.Redis, caps: dict[str, int],
                                           cost: int, turns: bool) -> None:
    store = PoolStore(redis_client, register_scripts(redis_client), "ties", PoolPolicy())
    await store.publish_state(1, Zone.GREEN, caps)
    nodes = []
    for i in range(4):
        got = await store.admit(task_id=f"t{i}", tenant=TENANT, tier=Tier.NORMAL,
                                prompt_tokens=cost // 2, max_tokens=cost - cost // 2,
                                gateway="gw", queue_timeout_ms=1_000)
        nodes.append(got.node)
        await store.settle(f"t{i}", 0)
    assert nodes == (["node-a", "node-b"] * 2 if turns else ["node-b"] * 4)


MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def two_gateways(redis_url: str, backends: list[InstantBackend],
                       capacities: dict[str, int]) -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """Two gateways ("gw-a", "gw-b") in front of the same backends, each with its own Redis
    connections; the pool's state published once (stale_after_ms 0: it never goes stale)."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_backend(b)) for b in backends]
        config = parse_config(config_data(redis_url, urls), env={})
        clients = []
        for gid in ("gw-a", "gw-b"):
            app = create_app(config, gateway_id=gid, settle_drain_s=0.5)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            stack.push_async_callback(server.close)
            await app[GATEWAY].hub.subscribed.wait()
            sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")),
                                     api_key=KEYS["normal"], max_retries=0)
            stack.push_async_callback(sdk.close)
            clients.append(sdk)
        redis = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(redis.aclose)
        store = PoolStore(redis, register_scripts(redis), POOL, config.pool_policy(POOL))
        await store.publish_state(1, Zone.GREEN, capacities)
        yield clients


REQUESTS = 120
MAX_SHARE = 0.6


@pytest.mark.parametrize("pattern", ["one-client-alternating", "two-clients"])
@pytest.mark.parametrize("capacities", [
    pytest.param({"node-0": 100_000, "node-1": 100_000}, id="equal-budgets"),
    pytest.param({"node-0": 101_000, "node-1": 100_000}, id="budgets-1pc-apart"),
])
async def test_short_requests_through_two_gateways_spread_over_two_idle_nodes(
        redis_client: aioredis.Redis, redis_url: str, capacities: dict[str, int],
        pattern: str) -> None:
    """Short requests one after the other, from one client taking the gateways in turn or from
    two clients, one per gateway, at the same time: neither node may get more than MAX_SHARE
    of them."""
    backends = [InstantBackend(model=POOL, max_model_len=4096) for _ in range(2)]
    async with two_gateways(redis_url, backends, capacities) as clients:
        async def client_loop(sdks: list[openai.AsyncOpenAI], n: int) -> None:
            for i in range(n):
                await sdks[i % len(sdks)].chat.completions.create(
                    model=POOL, messages=MESSAGES, max_tokens=4)

        if pattern == "two-clients":
            await asyncio.gather(*(client_loop([sdk], REQUESTS // 2) for sdk in clients))
        else:
            await client_loop(clients, REQUESTS)
    counts = [len(b.received) for b in backends]
    print(f"requests per node: {counts}")
    assert sum(counts) == REQUESTS
    assert max(counts) <= MAX_SHARE * REQUESTS, counts

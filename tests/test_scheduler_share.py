"""Batch's minimum share in GREEN (`zones.batch_min_share`): the leader's credit arithmetic
against a ledger of every token released, and a leader ticking against real Redis with a
Normal backlog that fills the pool, where Batch gets its share of the released tokens (and
nothing with the setting off)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from admission.config import ZoneSettings
from admission.tiers import Tier, Zone
from scheduler.policy import BatchShare, ReleasePolicy
from tests.scheduler_stub import (
    FakeClock,
    FakeVllm,
    always,
    make_config,
    pool_scheduler,
    queue_tasks,
    serve_fake,
)

BATCH_SIZE = 16
shares = st.floats(0.01, 0.5)


@given(share=shares, cost=st.integers(1, 50_000),
       ticks=st.lists(st.integers(0, BATCH_SIZE), min_size=1, max_size=40))
def test_credit_is_the_share_of_the_ledger_when_batch_can_always_be_placed(
    share: float, cost: int, ticks: list[int]
) -> None:
    """Every task costs the same and every owed Batch task is placed: the credit is exactly
    `share` of all tokens released minus Batch's (nothing is capped), Batch is never behind
    by more than the last tick's higher-tier releases earned it, and never ahead by a task."""
    account = BatchShare(share, BATCH_SIZE)
    batch_tokens = total = 0
    for higher in ticks:
        owed = account.owed()
        assert 0 <= owed <= BATCH_SIZE
        account.observe([(Tier.BATCH, cost)] * owed + [(Tier.NORMAL, cost)] * higher, True)
        batch_tokens += owed * cost
        total += (owed + higher) * cost
        behind = share * total - batch_tokens
        assert abs(account.credit - behind) <= 1e-6 * total + 1e-6
        assert behind <= share * higher * cost * (1 + 1e-9)
        assert behind > -(1 - share) * cost * (1 + 1e-9)


released = st.lists(st.tuples(st.sampled_from(list(Tier)), st.integers(1, 100_000)),
                    max_size=2 * BATCH_SIZE)


@given(share=shares, ticks=st.lists(st.tuples(released, st.booleans()), max_size=30))
def test_credit_stays_within_its_cap_whatever_is_released(
    share: float, ticks: list[tuple[list[tuple[Tier, int]], bool]]
) -> None:
    account = BatchShare(share, BATCH_SIZE)
    for tasks, contested in ticks:
        account.observe(tasks, contested)
        cap = account.cap(sum(cost for _, cost in tasks))
        assert -cap <= account.credit <= cap
        if not contested:
            assert account.credit == 0
        owed = account.owed()
        assert (owed > 0) == (account.credit > 0)
        assert owed <= BATCH_SIZE


def test_no_credit_is_banked_while_batch_is_idle_or_cannot_be_placed() -> None:
    account = BatchShare(0.5, 2_000)
    for _ in range(100):  # nothing of Batch waits: nothing is owed to it
        account.observe([(Tier.NORMAL, 10_000)], False)
    assert account.credit == 0 and account.owed() == 0
    for _ in range(100):  # Batch waits, but none of it fits: its credit stops at the cap
        account.observe([(Tier.NORMAL, 10_000)], True)
    assert account.credit == BatchShare.CREDIT_TASKS * 10_000
    assert account.owed() == 8  # 40,000 tokens at (1 - 0.5) x 10,000 a task, not 100 ticks' worth
    account.observe([(Tier.BATCH, 2_000)] * 8, True)  # smaller than guessed: still owed ...
    assert 0 < account.credit <= account.cap(16_000)
    # ... at Batch's own average cost from now on: (1 - 0.5) x 2,000 tokens a task.
    assert account.owed() == math.ceil(account.credit / 1_000)


def test_share_applies_in_green_while_batch_and_a_higher_tier_wait() -> None:
    policy = ReleasePolicy(ZoneSettings(batch_min_share=0.2), batch_size=100, now=0.0)
    policy.limits(Zone.GREEN, 0.0)
    policy.share_observe(Zone.GREEN, [(Tier.NORMAL, 1_000)], True)
    assert policy.share_limit(Zone.GREEN, (0, 5, 5)) == 1
    assert policy.share_limit(Zone.GREEN, (5, 0, 5)) == 1
    assert policy.share_limit(Zone.GREEN, (0, 0, 5)) == 0  # nothing to pass
    assert policy.share_limit(Zone.GREEN, (0, 5, 0)) == 0  # no Batch waits
    assert policy.share_limit(Zone.YELLOW, (0, 5, 5)) == 0
    policy.limits(Zone.YELLOW, 1.0)  # a zone change closes the account
    policy.limits(Zone.GREEN, 2.0)
    assert policy.share_limit(Zone.GREEN, (0, 5, 5)) == 0
    policy.share_observe(Zone.YELLOW, [(Tier.NORMAL, 1_000)], True)  # owed nothing outside GREEN
    assert policy.share_limit(Zone.GREEN, (0, 5, 5)) == 0
    off = ReleasePolicy(ZoneSettings(), batch_size=100, now=0.0)
    off.share_observe(Zone.GREEN, [(Tier.NORMAL, 1_000)], True)
    assert off.share_limit(Zone.GREEN, (0, 5, 5)) == 0


NORMAL_COST, BATCH_COST = 10_000, 5_000


async def run_backlog(redis_client: Any, redis_url: str, share: float, rounds: int
                      ) -> tuple[int, int, int]:
    """A GREEN pool of one node (78,000 tokens for Normal, 70,000 for Batch), a standing
    Normal backlog that fills it on every tick and a Batch backlog; every released task ends
    before the next tick. Returns (Batch tokens, all tokens, Normal tasks still queued) over
    `rounds` ticks plus what the Batch share let out at the start of one more: the credit the
    last round earned is paid there, before the higher tiers release."""
    clock = FakeClock()
    async with serve_fake(FakeVllm(usage=0.0)) as url:
        config = make_config(redis_url, [{"name": "n1", "url": url}],
                             zones={"batch_min_share": share})
        async with pool_scheduler(redis_client, config, clock=clock) as ps:
            await queue_tasks(ps.store, [
                *((f"n{i}", Tier.NORMAL, NORMAL_COST) for i in range(50)),
                *((f"b{i}", Tier.BATCH, BATCH_COST) for i in range(40)),
            ])
            batch = total = 0
            for round_ in range(rounds + 1):
                result = await ps.tick(1, always)
                assert result.zone is Zone.GREEN
                counted = result.released if round_ < rounds else result.released[:result.shared]
                for task in counted:
                    assert task.node is not None
                    assert task.cost == (BATCH_COST if task.tier is Tier.BATCH else NORMAL_COST)
                    total += task.cost
                    batch += task.cost if task.tier is Tier.BATCH else 0
                for task in result.released:
                    await ps.store.settle(task.task_id, task.cost)
                clock.advance(0.1)
            queued = await redis_client.zcard(ps.store.keys.queues[Tier.NORMAL])
    return batch, total, queued


async def test_batch_gets_its_share_of_tokens_past_a_normal_backlog(
    redis_client: Any, redis_url: str
) -> None:
    batch, total, queued = await run_backlog(redis_client, redis_url, 0.25, rounds=6)
    assert queued > 0  # Normal waited throughout
    assert batch >= 0.25 * total
    assert batch <= 0.25 * total + BATCH_COST  # at least its share, not much more


async def test_without_a_share_batch_waits_behind_normal(
    redis_client: Any, redis_url: str
) -> None:
    batch, total, queued = await run_backlog(redis_client, redis_url, 0.0, rounds=6)
    assert queued > 0 and total > 0
    assert batch == 0

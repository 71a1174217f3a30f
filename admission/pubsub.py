"""Pub/sub on kvgate's channels: the gateways' wake channels and the scheduler's handover.

Pub/sub is at most once; both users treat a message as a hint that saves waiting for their
timed fallback (the gateway's record check, the standby's lease retry), never as the truth.
The channel names come from the key schema (admission.keys); the services pass stores or ask
for the handover subscription, and never subscribe or publish themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from admission.keys import SchedulerKeys

MESSAGE_KINDS = ("message", "smessage")
SUBSCRIBE_KINDS = ("subscribe", "ssubscribe")


class Subscription:
    """One pub/sub connection subscribed to `channels`; `sharded`: SSUBSCRIBE (Redis 7
    sharded pub/sub, each channel served by its own slot's shard).

    `per_shard`: the channels are on one shard of a Redis Cluster and read with redis-py's
    sharded reader; a subscription that lost its shard's connection then raises
    ConnectionError instead of returning at once, for ever, with nothing to read.
    """

    def __init__(self, client: Any, channels: Sequence[str], *, sharded: bool = False,
                 per_shard: bool = False) -> None:
        self.client = client
        self.channels = list(channels)
        self.sharded = sharded
        self.per_shard = per_shard
        self._pubsub = client.pubsub()

    async def open(self) -> None:
        if isinstance(self.client, RedisCluster):
            # Cluster pub/sub looks the channel's node up in the slot map, which is empty
            # until the client's first command: fill it (a no-op afterwards).
            await self.client.initialize()
        if self.sharded:
            await self._pubsub.ssubscribe(*self.channels)
        else:
            await self._pubsub.subscribe(*self.channels)

    async def get(self, timeout_s: float) -> tuple[str, Any] | None:
        """The next message or subscription confirmation as (kind, data), or None when
        nothing came within `timeout_s`. Kinds: MESSAGE_KINDS, SUBSCRIBE_KINDS, others."""
        if self.per_shard:
            if not self._pubsub.node_pubsub_mapping:
                raise ConnectionError("shard subscription lost")
            message = await self._pubsub.get_sharded_message(timeout=timeout_s)
        else:
            message = await self._pubsub.get_message(timeout=timeout_s)
        if message is None:
            return None
        return str(message.get("type")), message.get("data")

    async def aclose(self) -> None:
        await self._pubsub.aclose()


def handover_subscription(client: Any) -> Subscription:
    """The scheduler replicas' handover channel: a resigning leader announces itself there."""
    return Subscription(client, [SchedulerKeys().handover])


async def announce_handover(client: Any, me: str) -> None:
    """Tell the standbys that `me` resigned, so that they try to lead at once."""
    await client.publish(SchedulerKeys().handover, me)

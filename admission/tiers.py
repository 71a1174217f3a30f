"""Priority tiers and load zones, the two vocabularies every component shares."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """Lower value = higher priority, as vLLM's `priority` field orders requests."""

    VIP = 0
    NORMAL = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return _TIER_LABELS[self]

    @classmethod
    def parse(cls, value: str | int) -> Tier:
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; expected vip, normal or batch") from None


# Read on every request (metric labels); Enum's `name` is a descriptor lookup each time.
_TIER_LABELS = {tier: tier.name.lower() for tier in Tier}


class Zone(enum.StrEnum):
    GREEN = "GREEN"
    YELLOW = "YELLOW"
    RED = "RED"

"""`[[teams]]`: quota levels that enclose tenants (a team, an organisation), and the tenant
keys that place a tenant under one.

A request debits its tenant's bucket and the bucket of every level above it, in the one admit
call, and is refused when any of them cannot pay (lua/_quota.lua, "Quota levels";
docs/architecture.md, "Quotas in levels"). A team names its `parent` (another team: an
organisation, a department), so the levels form a forest; a tenant names its `team`. Each
level has a token bucket (`rate`, `burst`) and optional daily and monthly allowances. Every
level is per pool, as tenants' buckets are (one pool's keys live in one Redis slot).

Validated at start: names unique and well-formed, every parent and every tenant's team
known, no cycle, and no level that could never let one of its tenants' largest requests
through (a burst or allowance below a member's burst).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from admission.configfields import ConfigError, KeyName, at_least
from admission.keys import check_name
from admission.store import QuotaLevel


@dataclass(frozen=True, slots=True)
class TeamSettings:
    name: str
    rate: int = at_least(0, 100_000)
    """Bucket refill, tokens per second, shared by every tenant under the team."""
    burst: int = at_least(1, 1_000_000)
    """Bucket size, tokens."""
    parent: str | None = None
    """The team (organisation) enclosing this one; None: a top level."""
    daily_tokens: int = at_least(0, 0)
    """Tokens per UTC day for everything under the team (0: no allowance)."""
    monthly_tokens: int = at_least(0, 0)
    """Tokens per UTC month for everything under the team (0: no allowance)."""

    def check(self, key: KeyName) -> None:
        try:
            check_name("team", self.name)
        except ValueError as exc:
            raise ConfigError(f"{key('name')}: {exc}") from None
        if self.burst > 1_000_000_000:
            raise ConfigError(f"{key('burst')}: must be at most 1e9 tokens")

    @property
    def level(self) -> QuotaLevel:
        return QuotaLevel(self.name, self.rate, self.burst, self.daily_tokens,
                          self.monthly_tokens)


def check_teams(teams: Iterable[TeamSettings]) -> dict[str, TeamSettings]:
    """The teams by name; ConfigError for a duplicate, an unknown parent or a cycle."""
    by_name: dict[str, TeamSettings] = {}
    for i, team in enumerate(teams):
        if team.name in by_name:
            raise ConfigError(f"teams[{i}].name: team {team.name!r} is defined twice")
        by_name[team.name] = team
    for i, team in enumerate(by_name.values()):
        if team.parent is not None and team.parent not in by_name:
            raise ConfigError(f"teams[{i}].parent: unknown team {team.parent!r} (parents must "
                              "be teams defined in [[teams]])")
    for team in by_name.values():
        seen = [team.name]
        parent = team.parent
        while parent is not None:
            if parent in seen:
                cycle = " -> ".join([*seen[seen.index(parent):], parent])
                raise ConfigError(f"teams: the parents of team {team.name!r} form a cycle "
                                  f"({cycle})")
            seen.append(parent)
            parent = by_name[parent].parent
    return by_name


def levels_of(team: str | None, teams: Mapping[str, TeamSettings]) -> tuple[QuotaLevel, ...]:
    """The levels enclosing a tenant of `team`, innermost first (checked teams: no cycle)."""
    out: list[QuotaLevel] = []
    while team is not None:
        settings = teams[team]
        out.append(settings.level)
        team = settings.parent
    return tuple(out)


def check_members(tenants: Iterable[tuple[str, str | None, int]],
                  teams: Mapping[str, TeamSettings]) -> None:
    """Each tenant, given as (where, team, burst): its team exists, and no level above it is
    smaller than its largest request (it could never pass there)."""
    for where, team, burst in tenants:
        if team is None:
            continue
        if team not in teams:
            raise ConfigError(f"{where}.team: unknown team {team!r} (define it in [[teams]])")
        for level in levels_of(team, teams):
            for name, size in (("burst", level.burst), ("daily_tokens", level.daily_tokens),
                               ("monthly_tokens", level.monthly_tokens)):
                if 0 < size < burst or (name == "burst" and size < burst):
                    raise ConfigError(
                        f"{where}.burst: {burst} tokens, more than team {level.name!r}'s "
                        f"{name} ({size}): its largest requests could never pass there")

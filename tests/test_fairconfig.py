"""The fairness keys of the configuration (admission/fairconfig.py): parsed, bounded, and
handed to the scripts through the pool policy and the tenant's quota."""

from __future__ import annotations

from typing import Any

import pytest

from admission.config import ConfigError, parse_config


def data(**tenant: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "backends": ["http://127.0.0.1:9"], "fairness": {}}],
        "tenants": [{"name": "acme", "tier": "normal", **tenant}],
    }


def test_weight_defaults_to_one_and_reaches_the_quota() -> None:
    config = parse_config(data(), env={})
    assert config.tenants[0].quota.weight == 1.0
    assert config.pool_policy("p").fair
    assert parse_config(data(weight=3), env={}).tenants[0].quota.weight == 3.0


@pytest.mark.parametrize("weight", [0, -1, 0.001, 20_000])
def test_a_weight_out_of_bounds_is_a_clear_error(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.weight: must be between 0.01 and 10000"):
        parse_config(data(weight=weight), env={})


def test_fifo_when_fairness_is_off() -> None:
    raw = data()
    raw["pools"][0]["fairness"] = {"enabled": False}
    assert not parse_config(raw, env={}).pool_policy("p").fair


def test_caps_reach_the_quota() -> None:
    quota = parse_config(data(burst=1_000, max_queued_tokens=5_000, max_inflight_tokens=1_000),
                         env={}).tenants[0].quota
    assert (quota.max_queued_tokens, quota.max_inflight_tokens) == (5_000, 1_000)


@pytest.mark.parametrize("key", ["max_queued_tokens", "max_inflight_tokens"])
def test_a_cap_below_the_burst_is_a_clear_error(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"tenants\[0\]\.{key}: must be 0 \(no cap\) or at "
                                          r"least the tenant's burst \(1000\)"):
        parse_config(data(burst=1_000, **{key: 999}), env={})


def teams_data(teams: list[dict[str, Any]], **tenant: Any) -> dict[str, Any]:
    raw = data(**tenant)
    raw["teams"] = teams
    return raw


def test_levels_enclose_a_tenant_innermost_first() -> None:
    config = parse_config(teams_data(
        [{"name": "corp", "rate": 500, "burst": 200_000, "monthly_tokens": 10**7},
         {"name": "crew", "parent": "corp", "rate": 100, "burst": 100_000,
          "daily_tokens": 10**6}],
        team="crew", daily_tokens=100_000), env={})
    quota = config.quota_of(config.tenants[0])
    assert [lvl.name for lvl in quota.levels] == ["crew", "corp"]
    assert (quota.levels[0].daily_tokens, quota.levels[1].monthly_tokens) == (10**6, 10**7)
    assert quota.daily_tokens == 100_000
    assert config.tenants[0].quota.levels == ()  # the tenant's own limits only


@pytest.mark.parametrize(("teams", "tenant", "message"), [
    ([{"name": "a", "parent": "b"}], {}, r"teams\[0\]\.parent: unknown team 'b'"),
    ([{"name": "a", "parent": "b"}, {"name": "b", "parent": "a"}], {},
     r"teams: the parents of team 'a' form a cycle \(a -> b -> a\)"),
    ([{"name": "a", "parent": "a"}], {}, r"form a cycle \(a -> a\)"),
    ([{"name": "a"}, {"name": "a"}], {}, r"teams\[1\]\.name: team 'a' is defined twice"),
    ([{"name": "a"}], {"team": "nope"}, r"tenants\[0\]\.team: unknown team 'nope'"),
    ([{"name": "a", "burst": 10}], {"team": "a"},
     r"tenants\[0\]\.burst: 100000 tokens, more than team 'a''s burst \(10\)"),
    ([{"name": "a", "daily_tokens": 50_000}], {"team": "a"},
     r"more than team 'a''s daily_tokens \(50000\)"),
    ([{"name": "bad name"}], {}, r"teams\[0\]\.name: team name 'bad name' must be"),
    ([{"name": "a", "rate": -1}], {}, r"teams\[0\]\.rate: must be >= 0"),
])
def test_a_bad_hierarchy_is_a_clear_error_at_start(teams: list[dict[str, Any]],
                                                   tenant: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(teams_data(teams, **tenant), env={})

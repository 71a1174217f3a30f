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

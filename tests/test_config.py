"""Configuration: validated at start, every error names the key that is wrong."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from admission.config import (
    ConfigError,
    check_mounted_files,
    load_config,
    parse_config,
    startup_warnings,
)
from admission.tiers import Tier
from kvgate_client import KvgateClient

KEY_HASH = hashlib.sha256(b"sk-test").hexdigest()


def minimal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pools": [{"name": "llama", "backends": ["http://127.0.0.1:9001/"]}],
        "tenants": [{"name": "acme", "tier": "vip", "key_sha256": [KEY_HASH]}],
    }
    data.update(overrides)
    return data


def test_minimal_config_gets_defaults() -> None:
    config = parse_config(minimal(), env={})
    pool = config.pools["llama"]
    assert pool.backends[0].url == "http://127.0.0.1:9001"
    assert pool.backends[0].name == "node-0"
    assert config.tenants[0].tier is Tier.VIP
    assert config.scheduler.poll_interval_ms == 50
    assert config.pool_policy("llama").tier_queue_caps == (10_000, 10_000, 100_000)


def test_redis_url_from_environment_wins() -> None:
    config = parse_config(minimal(redis={"url": "redis://file:1/0"}),
                          env={"REDIS_URL": "rediss://env:2/0"})
    assert config.redis.url == "rediss://env:2/0"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (minimal(pools=[]), "pools: at least one"),
        (minimal(pools=[{"name": "a b"}]), "pools[0].name: pool name 'a b'"),
        (minimal(pools=[{"name": "p", "zones": {"red": 1.5}}]), "pools[0].zones.red: must be"),
        (minimal(pools=[{"name": "p", "zones": {"yellow": 0.9, "red": 0.8}}]),
         "pools[0].zones.yellow: must be below"),
        (minimal(pools=[{"name": "p", "context_length": "big"}]),
         "pools[0].context_length: expected an integer, got str"),
        (minimal(pools=[{"name": "p", "backends": [{"url": "ftp://x", "name": "n"}]}]),
         "pools[0].backends[0].url: must be an http"),
        (minimal(tenants=[{"name": "t", "tier": "gold"}]), "tenants[0].tier: unknown tier"),
        (minimal(tenants=[{"name": "t", "tier": "vip", "key_sha256": ["sk-plain"]}]),
         "tenants[0].key_sha256[0]: must be a lowercase hex SHA-256"),
        (minimal(tenants=[{"name": "t", "tier": "vip", "rate": -1}]),
         "tenants[0].rate: must be >= 0"),
        (minimal(gateway={"lease_ttl_ms": 1000, "renew_interval_ms": 800}),
         "gateway.renew_interval_ms: must be at most half"),
        (minimal(gateway={"port": True}), "gateway.port: expected an integer, got a boolean"),
        (minimal(gateway={"port": 99999}), "gateway.port: must be between 0 and 65535, got 99999"),
        (minimal(gateway={"port": -1}), "gateway.port: must be between 0 and 65535, got -1"),
        (minimal(scheduler={"port": 65536}),
         "scheduler.port: must be between 0 and 65535, got 65536"),
        (minimal(pools=[{"name": "p", "context_length": 4096}]),
         "pools[0].max_max_tokens: must be at most pools[0].context_length (4096), got 8192"),
        (minimal(scheduler={"stale_policy": "hope"}), "scheduler.stale_policy: must be"),
        (minimal(redis={"url": "http://x"}), "redis.url: must start with"),
        (minimal(tiers={"vip": {"max_queued": -5}}), "tiers.vip.max_queued: must be >= 0"),
        (minimal(pools=[{"name": "p", "engine": {"dispatch_ms": 0}}]),
         "pools[0].engine.dispatch_ms: must be >= 1, got 0"),
        (minimal(pools=[{"name": "p", "engine": {"prefill_us_per_token": 66.5}}]),
         "pools[0].engine.prefill_us_per_token: expected an integer, got float"),
        (minimal(pools=[{"name": "p", "engine": {"prefill_tokens_per_s": 1}}]),
         "pools[0].engine.prefill_tokens_per_s: unknown key"),
        (minimal(gatewy={}), "gatewy: unknown key"),
        (minimal(gateway={"prot": 1}), "gateway.prot: unknown key"),
    ],
)
def test_errors_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data, env={})
    assert message in str(err.value)


def test_duplicate_keys_across_tenants_are_refused() -> None:
    tenants = [
        {"name": "a", "tier": "vip", "key_sha256": [KEY_HASH]},
        {"name": "b", "tier": "batch", "key_sha256": [KEY_HASH]},
    ]
    with pytest.raises(ConfigError, match="also listed for tenant 'a'"):
        parse_config(minimal(tenants=tenants), env={})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pools\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    no_ca = tmp_path / "no_ca.toml"
    no_ca.write_text('[[pools]]\nname = "p"\nbackend_ca_file = "/nonexistent/ca.pem"\n'
                     'backends = [{ name = "n1", url = "https://10.0.0.1:8000" }]\n')
    with pytest.raises(ConfigError, match=r"backend_ca_file '/nonexistent/ca\.pem': cannot load"):
        check_mounted_files(load_config(no_ca))


def test_sentinel_settings() -> None:
    redis = parse_config(minimal(redis={
        "sentinel_master": "kvgate", "sentinels": ["10.0.0.1:26379", "[fd00::2]:26380"]}),
        env={}).redis
    assert redis.sentinel_addresses() == [("10.0.0.1", 26379), ("fd00::2", 26380)]


@pytest.mark.parametrize(("redis", "message"), [
    ({"sentinels": ["s:26379"]}, "redis.sentinel_master: is required with redis.sentinels"),
    ({"sentinel_master": "kvgate"}, "redis.sentinels: at least one"),
    ({"sentinel_master": "kvgate", "sentinels": ["s"]}, "redis.sentinels[0]: 's' is not"),
    ({"sentinel_master": "kvgate", "sentinels": ["s:0"]}, "redis.sentinels[0]: 's:0' is not"),
    ({"sentinel_master": "kvgate", "sentinels": [26379]}, "redis.sentinels[0]: expected a str"),
    ({"sentinel_master": "my master", "sentinels": ["s:1"]}, "redis.sentinel_master: must be"),
    ({"sentinel_master": "kvgate", "sentinels": ["s:1"], "cluster": True},
     "redis.sentinel_master: not with redis.cluster = true"),
    ({"sentinel_master": "kvgate", "sentinels": ["s:1"], "url": "unix:///run/redis.sock"},
     "redis.url: must be redis:// or rediss:// with Sentinel"),
])
def test_sentinel_errors_name_the_key(redis: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(minimal(redis=redis), env={})
    assert str(caught.value).startswith(message)


SENTINELS = {"sentinel_master": "kvgate", "sentinels": ["s:26379"]}
SENTINEL_SECRET = "s3nt1nel-pw"


def test_the_sentinels_password_is_read_from_the_variable_the_file_names() -> None:
    redis = parse_config(minimal(redis={
        **SENTINELS, "url": "redis://:primary-pw@/0", "sentinel_username": "kvgate",
        "sentinel_password_env": "SENTINEL_PW"}), env={"SENTINEL_PW": SENTINEL_SECRET}).redis
    assert (redis.sentinel_username, redis.sentinel_password_env, redis.sentinel_password) == (
        "kvgate", "SENTINEL_PW", SENTINEL_SECRET)
    assert redis.url == "redis://:primary-pw@/0"  # the primary's credentials stay the URL's
    assert SENTINEL_SECRET not in repr(redis)  # a logged settings object does not show it
    # Unset, the Sentinels get no credentials.
    plain = parse_config(minimal(redis=SENTINELS), env={"SENTINEL_PW": SENTINEL_SECRET}).redis
    assert (plain.sentinel_username, plain.sentinel_password) == (None, None)


@pytest.mark.parametrize(("redis", "env", "message"), [
    ({"sentinel_password_env": "SENTINEL_PW"}, {"SENTINEL_PW": SENTINEL_SECRET},
     "redis.sentinel_password_env: only with redis.sentinel_master"),
    ({"sentinel_username": "kvgate"}, {},
     "redis.sentinel_username: only with redis.sentinel_master"),
    ({**SENTINELS, "sentinel_password_env": "SENTINEL_PW"}, {},
     "redis.sentinel_password_env: names SENTINEL_PW, which is not set (or empty)"),
    ({**SENTINELS, "sentinel_password_env": "SENTINEL_PW"}, {"SENTINEL_PW": ""},
     "redis.sentinel_password_env: names SENTINEL_PW, which is not set (or empty)"),
    ({**SENTINELS, "sentinel_password_env": f"{SENTINEL_SECRET}!"}, {},
     "redis.sentinel_password_env: must be the name of an environment variable"),
    ({**SENTINELS, "sentinel_username": "kvgate"}, {},
     "redis.sentinel_username: needs redis.sentinel_password_env"),
    ({**SENTINELS, "sentinel_username": "kv gate", "sentinel_password_env": "SENTINEL_PW"},
     {"SENTINEL_PW": SENTINEL_SECRET}, "redis.sentinel_username: must be a user name"),
    ({**SENTINELS, "sentinel_username": "", "sentinel_password_env": "SENTINEL_PW"},
     {"SENTINEL_PW": SENTINEL_SECRET}, "redis.sentinel_username: must be a user name"),
    ({**SENTINELS, "sentinel_password": SENTINEL_SECRET}, {},
     "redis.sentinel_password: a password is never written in the file"),
])
def test_sentinel_credentials_errors_name_the_key_and_never_the_password(
    redis: dict[str, Any], env: dict[str, str], message: str,
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(minimal(redis=redis), env=env)
    assert str(caught.value).startswith(message), str(caught.value)
    assert SENTINEL_SECRET not in str(caught.value)


def test_dedicated_nodes_must_be_backends_of_the_pool_and_name_their_tiers() -> None:
    from admission.tiers import Tier

    def pool(dedicated: dict[str, object]) -> dict[str, object]:
        return {"pools": [{"name": "p", "dedicated": dedicated, "backends": [
            {"name": "gpu-0", "url": "http://127.0.0.1:9001"},
            {"name": "gpu-1", "url": "http://127.0.0.1:9002"}]}]}

    parsed = parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"]}), env={})
    assert parsed.pools["p"].dedicated.nodes == ("gpu-0",)
    assert parsed.pools["p"].dedicated.tier_mask == 1 << Tier.VIP
    with pytest.raises(ConfigError, match=r"pools\[0\]\.dedicated\.nodes\[0\]: 'gpu-9' is not"):
        parse_config(pool({"nodes": ["gpu-9"], "tiers": ["vip"]}), env={})
    with pytest.raises(ConfigError, match=r"dedicated\.tiers: name the tiers"):
        parse_config(pool({"nodes": ["gpu-0"]}), env={})
    with pytest.raises(ConfigError, match=r"dedicated\.tiers: unknown tier 'gold'"):
        parse_config(pool({"nodes": ["gpu-0"], "tiers": ["gold"]}), env={})
    with pytest.raises(ConfigError, match=r"dedicated\.nodes: leaves no backend"):
        parse_config(pool({"nodes": ["gpu-0", "gpu-1"], "tiers": ["vip"]}), env={})
    guests = parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                                "guest_max_prompt_tokens": 2048}), env={}).pools["p"].dedicated
    assert (guests.guest_max_prompt_tokens, guests.max_guests_per_node) == (2048, 32)
    assert parsed.pools["p"].dedicated.guest_max_prompt_tokens == 0
    with pytest.raises(ConfigError, match=r"dedicated\.guest_max_prompt_tokens: guests need"):
        parse_config(pool({"guest_max_prompt_tokens": 100}), env={})
    with pytest.raises(ConfigError, match=r"dedicated\.max_guests_per_node: must be >= 1"):
        parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"], "guest_max_prompt_tokens": 1,
                           "max_guests_per_node": 0}), env={})
    paced = parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                               "guest_max_prompt_tokens": 4096,
                               "guest_prompt_tokens_per_s": 5000}), env={}).pools["p"].dedicated
    assert paced.guest_prompt_tokens_per_s == 5000 and guests.guest_prompt_tokens_per_s == 0
    with pytest.raises(ConfigError, match=r"guest_prompt_tokens_per_s: paces guests, so it needs"):
        parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                           "guest_prompt_tokens_per_s": 5000}), env={})
    bounded = parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                                 "guest_max_prompt_tokens": 9000,
                                 "guest_max_output_tokens": 1000}), env={}).pools["p"].dedicated
    assert bounded.guest_max_output_tokens == 1000 and guests.guest_max_output_tokens == 0
    running = parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                                 "guest_max_prompt_tokens": 9000,
                                 "guest_max_running": 64}), env={}).pools["p"].dedicated
    assert running.guest_max_running == 64 and guests.guest_max_running == 0
    with pytest.raises(ConfigError, match=r"guest_max_running: bounds guests, so it needs"):
        parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                           "guest_max_running": 64}), env={})
    with pytest.raises(ConfigError, match=r"guest_max_output_tokens: bounds guests, so it needs"):
        parse_config(pool({"nodes": ["gpu-0"], "tiers": ["vip"],
                           "guest_max_output_tokens": 1000}), env={})


def test_tier_ceilings_default_to_the_zone_lines_and_keep_their_order() -> None:
    def zones(**z: object) -> Any:
        data = minimal()
        data["pools"][0]["zones"] = z
        return parse_config(data, env={}).pools["llama"].zones

    assert zones().ceilings() == (0.85, 0.78, 0.70)
    # Unset ceilings follow the lines they default to, so moving RED or YELLOW alone is valid.
    assert zones(yellow=0.6, red=0.8, kv_target=0.75).ceilings() == (0.8, 0.75, 0.6)
    assert zones(yellow=0.8, kv_target=0.78).ceilings() == (0.85, 0.78, 0.78)
    assert zones(vip_ceiling=0.82, batch_ceiling=0.5).ceilings() == (0.82, 0.78, 0.5)
    # The edges that stay valid: a hysteresis just under YELLOW, a small Normal ceiling.
    assert zones(yellow=0.3, hysteresis=0.29, kv_target=0.01).ceilings() == (0.85, 0.01, 0.01)
    for bad, message in [
        ({"batch_ceiling": 0.8}, r"zones\.batch_ceiling: must be at most pools\[0\]\.zones\.kv_"),
        ({"vip_ceiling": 0.75}, r"zones\.vip_ceiling: must be at least pools\[0\]\.zones\.kv_"),
        ({"vip_ceiling": 0.9}, r"zones\.vip_ceiling: must be at most pools\[0\]\.zones\.red"),
        ({"red": 0.75, "yellow": 0.7}, r"vip_ceiling: must be at least .*kv_target \(unset, it"),
        ({"vip_ceiling": 1.5}, r"zones\.vip_ceiling: must be between 0.0 and 1.0"),
        ({"batch_headroom": 0.03}, r"zones\.batch_headroom: replaced by .*batch_ceiling"),
        ({"yellow": 0.3, "hysteresis": 0.3}, r"zones\.hysteresis: must be below pools\[0\]\."
                                             r"zones\.yellow, or a pool that turned YELLOW"),
        ({"yellow": 0.0, "hysteresis": 0.0}, r"zones\.hysteresis: must be below"),
        ({"kv_target": 0.0, "batch_ceiling": 0.0}, r"zones\.kv_target: must be above 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            zones(**bad)


def test_batch_min_share_is_off_by_default_and_at_most_one_half() -> None:
    def zones(**z: object) -> Any:
        data = minimal()
        data["pools"][0]["zones"] = z
        return parse_config(data, env={}).pools["llama"].zones

    assert zones().batch_min_share == 0.0
    assert zones(batch_min_share=0.2, batch_trickle_rate=1.0).batch_min_share == 0.2
    for bad in (0.6, -0.1):
        with pytest.raises(ConfigError, match=r"^pools\[0\]\.zones\.batch_min_share: must be "
                                              rf"between 0\.0 and 0\.5, got {bad}$"):
            zones(batch_min_share=bad)
    with pytest.raises(ConfigError, match=r"pools\[0\]\.zones\.batch_min_share"):
        zones(batch_min_share="a tenth")


def test_ports_take_the_whole_range() -> None:
    config = parse_config(minimal(gateway={"port": 65535}, scheduler={"port": 0}), env={})
    assert (config.gateway.port, config.scheduler.port) == (65535, 0)


def test_the_sdks_default_to_the_gateways_default_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client built with no base URL reaches a gateway started with no port: the Python and
    Go SDKs' default and the gateway's are one port, and $KVGATE_BASE_URL overrides it."""
    port = parse_config(minimal(), env={}).gateway.port
    monkeypatch.delenv("KVGATE_BASE_URL", raising=False)
    with KvgateClient() as client:
        assert client._http.base_url.port == port
    go = re.search(r'DefaultBaseURL = "([^"]+)"',
                   (Path(__file__).parent.parent / "clients/go/client.go").read_text())
    assert go is not None and urlsplit(go.group(1)).port == port
    monkeypatch.setenv("KVGATE_BASE_URL", "http://gateway:9000/v1")
    with KvgateClient() as client:
        assert str(client._http.base_url) == "http://gateway:9000/v1/"
    with KvgateClient("http://other:1/v1") as client:
        assert client._http.base_url.host == "other"


def test_max_max_tokens_may_be_the_whole_context() -> None:
    pool = parse_config(minimal(pools=[{"name": "p", "context_length": 4096,
                                        "max_max_tokens": 4096}]), env={}).pools["p"]
    assert (pool.context_length, pool.max_max_tokens) == (4096, 4096)


def test_startup_warnings_name_a_stale_bound_below_the_poll_and_a_server_in_two_pools() -> None:
    pools = [{"name": "a", "stale_after_ms": 20, "backends": ["http://127.0.0.1:9001"]},
             {"name": "b", "backends": ["http://127.0.0.1:9002", "http://127.0.0.1:9001"]}]
    assert startup_warnings(parse_config(minimal(pools=pools), env={})) == [
        "pools[0].stale_after_ms 20 is below scheduler.poll_interval_ms 50: between the "
        "leader's polls its state is older than that, and requests then queue instead of "
        "taking the fast path",
        "pools[1].backends[1].url 'http://127.0.0.1:9001' is also pools[0].backends[0]'s: "
        "each pool counts that server's whole KV cache, so together they can place more than "
        "it holds (give the pools capacity_tokens that share it)"]
    # 0 turns the check off; at the poll interval the state is never older between polls.
    pools = [{"name": "a", "stale_after_ms": 0, "backends": ["http://127.0.0.1:9001"]},
             {"name": "b", "stale_after_ms": 50, "backends": ["http://127.0.0.1:9002"]}]
    assert startup_warnings(parse_config(minimal(pools=pools), env={})) == []


@pytest.mark.parametrize(("tenants", "expected"), [
    ([], ["no [[tenants]]: every request will get 401 (no API key can match)"]),
    ([{"name": "t", "tier": "vip"}],
     ["no tenant has a key_sha256: every request will get 401 (no API key can match)"]),
    ([{"name": "acme", "tier": "vip", "key_sha256": [KEY_HASH]},
      {"name": "tiny", "tier": "normal", "rate": 1_000_000, "burst": 9_999}],
     ["tenants[1] ('tiny'): burst 9999 is below 1% of its rate (1000000 tokens/s): every "
      "request of more than 9999 tokens (prompt + max_tokens) gets 400 exceeds_burst"]),
    # A burst of exactly 1% of the rate, and a rate of 0: nothing to warn about.
    ([{"name": "acme", "tier": "vip", "key_sha256": [KEY_HASH], "rate": 200_000,
       "burst": 2_000},
      {"name": "frozen", "tier": "batch", "rate": 0, "burst": 1_025}], []),
])
def test_startup_warnings_name_what_turns_requests_away(
    tenants: list[dict[str, Any]], expected: list[str]
) -> None:
    assert startup_warnings(parse_config(minimal(tenants=tenants), env={})) == expected

"""Abuse and bad input against a live gateway process (`python -m gateway` on loopback, an
instant backend process, a private redis-server):

- schemathesis drives every operation of the gateway's own `/openapi.json`, positive and
  negative cases: never a 5xx, every error in OpenAI's shape, responses as documented;
- hypothesis-generated bodies (huge and negative numbers, zero or negative max_tokens, wrong
  types, deep nesting, invalid UTF-8, bodies over the limit, thousands of messages, bad
  headers): each gets a 4xx in OpenAI's shape, and admission state (buckets, node_reserved,
  queues, counters) is exactly as before.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from admission.config import TenantSettings, parse_config
from admission.connection import connect
from admission.keys import PoolKeys
from admission.scripts import register_scripts
from admission.store import PoolStore
from admission.tiers import Tier, Zone
from bench.common.localredis import LocalRedis, start_redis
from gateway.auth import effective_tier
from gateway.errors import ApiError
from gateway.handlers import _client_timeout_ms
from tests.gateway_harness import KEYS, POOL, config_data, sha
from tests.live import Processes
from tests.properties import PROPERTIES, examples

MAX_BODY = 65_536
CONTEXT = 4096
ADMIN_TOKEN = "adm-abuse-token"
EXAMPLES = 25
"""Examples per operation and generation mode (schemathesis) and per category (hypothesis)."""
FUZZ = settings(PROPERTIES, max_examples=examples(EXAMPLES), phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@dataclass
class Live:
    url: str
    redis: redis.Redis
    keys: PoolKeys
    procs: Processes
    server: LocalRedis


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = start_redis()
    procs = Processes()
    client = redis.Redis.from_url(server.url)
    try:
        _, backend = procs.instant_backend("abuse-backend", model=POOL, output_tokens=2)
        data = config_data("redis://127.0.0.1:1/0", [backend], max_body_bytes=MAX_BODY,
                           admin_token_sha256=sha(ADMIN_TOKEN))
        # Small outputs: a valid generated request (n up to 128) stays cheap to serve.
        data["pools"][0].update(max_max_tokens=16, default_max_tokens=8,
                                context_length=CONTEXT)
        gateway = procs.gateway(procs.write_config(data), "gw-abuse", redis_url=server.url)
        config = parse_config(data, env={"REDIS_URL": server.url})
        asyncio.run(_publish(config.redis, config.pool_policy(POOL)))
        yield Live(gateway.url, client, PoolKeys(POOL), procs, server)
        assert gateway.child.alive(), "the gateway died: " + gateway.child.log_tail()
    finally:
        client.close()
        procs.cleanup()
        server.stop()


async def _publish(settings_: Any, policy: Any) -> None:
    client = connect(settings_)
    try:
        store = PoolStore(client, register_scripts(client), POOL, policy)
        await store.publish_state(1, Zone.GREEN, {"node-0": 10**9})
    finally:
        await client.aclose()


def rejected_by_http_parser(response: Any) -> bool:
    """aiohttp's own answer to a request that is not valid HTTP (it never reaches the app)."""
    return bool(
        response.status_code == 400
        and response.headers.get("Content-Type", "").startswith("text/plain")
        and response.headers.get("Connection", "").lower() == "close"
    )


def openai_error(body: bytes) -> dict[str, Any]:
    payload = json.loads(body)
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    error: dict[str, Any] = payload["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# --- schemathesis ----------------------------------------------------------------------------


def test_schemathesis_finds_no_server_error_and_only_openai_errors(live: Live) -> None:
    import schemathesis
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
    )
    from schemathesis.core.result import Ok

    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    auth = {"Authorization": f"Bearer {KEYS['vip']}"}
    checks = [not_a_server_error, content_type_conformance, response_schema_conformance]
    seen: dict[tuple[str, str], set[int]] = {}
    no_negative: list[str] = []
    parser_rejections: list[str] = []

    def fuzz(operation: Any, mode: Any, statuses: set[int]) -> Any:
        @given(case=operation.as_strategy(generation_mode=mode))
        @FUZZ
        def run(case: Any) -> None:
            response = case.call(base_url=live.url, headers=auth, timeout=30)
            statuses.add(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])
            if rejected_by_http_parser(response):
                # Malformed HTTP (negative mode mutates headers, e.g. an empty Content-Length)
                # is refused by aiohttp's parser before the application sees it: a plain-text
                # 400 that closes the connection, outside the gateway's OpenAI error shape.
                parser_rejections.append(response.text[:200])
                return
            if response.status_code >= 400:
                openai_error(response.content)
            case.validate_response(response, checks=checks)

        return run

    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the document itself is valid
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            run = fuzz(operation, mode, seen.setdefault((operation.label, mode.value), set()))
            try:
                run()
            except Unsatisfiable:
                # Nothing to make invalid: no body, no parameter (healthz, metrics, ...).
                assert mode is schemathesis.GenerationMode.NEGATIVE
                no_negative.append(operation.label)
    assert set(no_negative) <= {"GET /healthz", "GET /readyz", "GET /metrics",
                                "GET /openapi.json"}, no_negative
    chat = seen[("POST /v1/chat/completions", "positive")]
    assert 200 in chat, seen  # valid requests were generated and served
    assert seen[("POST /v1/completions", "negative")] & {400, 413, 422}, seen
    assert seen[("GET /admin/pools", "positive")] == {401}, seen
    assert live.procs.children[-1].alive()


# --- hypothesis-generated bodies -------------------------------------------------------------


def _post(live: Live, body: bytes, headers: dict[str, str] | None = None,
          path: str = "/v1/chat/completions", who: str = "normal") -> tuple[int, bytes]:
    request = urllib.request.Request(
        live.url + path, data=body, method="POST",
        headers={"Authorization": f"Bearer {KEYS[who]}", "Content-Type": "application/json",
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _admission_state(live: Live) -> dict[str, Any]:
    """Everything a rejected request must leave as it was."""
    k = live.keys
    pipe = live.redis.pipeline(transaction=True)
    pipe.hgetall(k.node_reserved)
    pipe.hgetall(k.stats)
    pipe.hgetall(k.tenant_queued)
    pipe.hgetall(k.bucket_key("normal"))
    pipe.hgetall(k.bucket_key("batch"))
    for queue in k.queues:
        pipe.zcard(queue)
    # (Not the leases: a gateway's entry goes when a renewal finds it holds nothing.)
    pipe.scard(k.gateway_tasks_key("gw-abuse"))
    names = ("node_reserved", "stats", "tenant_queued", "bucket_normal", "bucket_batch",
             "queue_vip", "queue_normal", "queue_batch", "gateway_tasks")
    return dict(zip(names, pipe.execute(), strict=True))


def _settled(live: Live, within_s: float = 10.0) -> None:
    """Until no reservation is held (earlier tests' settles run after their responses)."""
    deadline = time.monotonic() + within_s
    while live.redis.hlen(live.keys.node_reserved):
        assert time.monotonic() < deadline, "reservations never came back"
        time.sleep(0.01)


def _valid_priority(value: str) -> bool:
    try:
        effective_tier(NORMAL_TENANT, value)
    except ApiError:
        return False
    return True


NORMAL_TENANT = TenantSettings("normal", Tier.NORMAL, (), 1, 1, 1)


def _message(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": POOL, "messages": [_message()], **fields}


def _dumps(value: Any) -> bytes:
    """Python's encoder: writes what orjson never would (huge ints, NaN, Infinity)."""
    return json.dumps(value, allow_nan=True).encode()


def _nested(depth: int, leaf: str) -> str:
    """JSON text `depth` levels deep (lists and objects in turn) around `leaf` (JSON text);
    written out directly, as no encoder goes that deep."""
    opening = "".join('[' if i % 2 else '{"x":' for i in range(depth))
    closing = "".join(']' if i % 2 else '}' for i in reversed(range(depth)))
    return opening + leaf + closing


huge = st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63)),
                 st.sampled_from([10**30, -(10**30), 2**64, 10**400]))
bad_max_tokens = st.one_of(
    st.integers(max_value=0), st.integers(min_value=17, max_value=10**12), huge,
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=5),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2))
wrong_types = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                        st.text(max_size=8), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def bad_bodies(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """(what, raw body, extra headers) of a request that must be refused before admission."""
    kind = draw(st.sampled_from([
        "max_tokens", "max_completion_tokens", "n", "model", "messages", "field", "nesting",
        "utf8", "too_large", "many_messages", "headers", "completion_prompt",
    ]))
    if kind in ("max_tokens", "max_completion_tokens"):
        return kind, _dumps(_body(**{kind: draw(bad_max_tokens)})), {}
    if kind == "n":
        n = draw(st.one_of(st.integers(max_value=0), st.integers(min_value=129), huge,
                           st.floats(), st.text(max_size=3)))
        return kind, _dumps(_body(n=n)), {}
    if kind == "model":
        model = draw(wrong_types.filter(lambda m: m != POOL))
        return kind, _dumps({"model": model, "messages": [_message()]}), {}
    if kind == "messages":
        messages = draw(st.one_of(
            wrong_types.filter(lambda v: not isinstance(v, list) or v == []),
            st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none(),
                               st.fixed_dictionaries({"content": st.text(max_size=5)})),
                     min_size=1, max_size=4)))
        return kind, _dumps({"model": POOL, "messages": messages}), {}
    if kind == "field":
        name = draw(st.sampled_from(["stream", "stream_options", "tools"]))
        value = draw(wrong_types.filter(lambda v: v is not None and not (
            (name == "stream" and isinstance(v, bool))
            or (name == "stream_options" and isinstance(v, dict))
            or (name == "tools" and isinstance(v, list)))))
        return kind, _dumps(_body(**{name: value})), {}
    if kind == "nesting":
        depth = draw(st.integers(min_value=1, max_value=3000))
        where = draw(st.sampled_from(["messages", "max_tokens", "content"]))
        prefix = f'{{"model": "{POOL}", '
        if where == "messages":
            text = prefix + f'"messages": [{_nested(depth, chr(34) + "hi" + chr(34))}]}}'
        elif where == "max_tokens":
            text = prefix + f'"messages": [{{"role": "user", "content": "hi"}}], ' \
                f'"max_tokens": {_nested(depth, "5")}}}'
        else:  # a content that is neither a string nor a list of parts, however deep
            text = prefix + f'"messages": [{{"role": "user", "content": {{"x": ' \
                f'{_nested(depth, "1")}}}}}]}}'
        return kind, text.encode(), {}
    if kind == "utf8":
        valid = _dumps(_body())
        garbage = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88",
                                        b"\x80\x80", b"\xe2\x82", b"\\ud800", b"\\udc80x"]))
        at = draw(st.integers(min_value=0, max_value=len(valid)))
        if garbage.startswith(b"\\") or draw(st.booleans()):  # inside the prompt's string
            at = valid.index(b'"hi"') + 2
        return kind, valid[:at] + garbage + valid[at:], {}
    if kind == "too_large":
        extra = draw(st.integers(min_value=1, max_value=MAX_BODY))
        body = _dumps(_body(padding="x" * (MAX_BODY + extra)))
        return kind, body, {}
    if kind == "many_messages":
        count = draw(st.integers(min_value=1_000, max_value=4_000))
        return kind, _dumps({"model": POOL, "messages": [_message("hello there")] * count}), {}
    if kind == "completion_prompt":
        prompt = draw(st.one_of(
            st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
            st.lists(huge, min_size=1, max_size=2), st.just([]), st.just([[]]),
            st.none(), st.integers(), st.dictionaries(st.text(max_size=3), st.integers(),
                                                      min_size=1, max_size=2)))
        return kind, _dumps({"model": POOL, "prompt": prompt}), {"X-Path": "/v1/completions"}
    header = draw(st.sampled_from(["X-Priority", "X-Request-Timeout"]))
    value = draw(st.one_of(
        st.sampled_from(["nan", "inf", "-1", "0", "1e400", "-inf", "vipp", "-0", "3x", "",
                         " ", "0x10", "9" * 400, "4"]),
        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=6)))
    if header == "X-Priority" and _valid_priority(value):
        value = "urgent"
    if header == "X-Request-Timeout":
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if seconds > 0 and math.isfinite(seconds):
            value = "-" + value
    return "headers", _dumps(_body()), {header: value}


@given(case=bad_bodies())
@settings(FUZZ, max_examples=examples(EXAMPLES * 8))
def test_bad_bodies_get_a_4xx_and_leave_the_budget_untouched(
        live: Live, case: tuple[str, bytes, dict[str, str]]) -> None:
    what, body, headers = case
    path = headers.pop("X-Path", "/v1/chat/completions")
    _settled(live)
    before = _admission_state(live)
    status, answer = _post(live, body, headers, path=path)
    assert 400 <= status < 500 and status != 429, (what, status, answer[:300], body[:200])
    error = openai_error(answer)
    if what == "too_large":
        assert status == 413 and error["code"] == "request_too_large"
    assert _admission_state(live) == before, what


def test_huge_client_timeout_is_capped_not_a_crash() -> None:
    """Found by schemathesis: `X-Request-Timeout: 1e308` overflowed to a 500."""
    assert _client_timeout_ms("1e308") == int(1e12)
    assert _client_timeout_ms("0.0001") == 1
    assert _client_timeout_ms(None) is None


def test_a_valid_request_after_the_abuse_is_served_and_settled(live: Live) -> None:
    status, answer = _post(live, _dumps(_body(max_tokens=2)))
    assert status == 200, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2
    stats = live.redis.hgetall(live.keys.stats)
    assert int(stats[b"fast_path"]) >= 1


def test_out_of_range_token_ids_are_refused_before_admission(live: Live) -> None:
    """Found by the fuzzer: a token id of 2**63 was admitted (only the node would refuse it)."""
    _settled(live)
    before = _admission_state(live)
    for prompt in ([2**63], [[1, 2], [2**31]], [-1]):
        status, answer = _post(live, _dumps({"model": POOL, "prompt": prompt}),
                               path="/v1/completions")
        assert status == 400 and openai_error(answer)["param"].startswith("prompt"), prompt
    assert _admission_state(live) == before
    status, _ = _post(live, _dumps({"model": POOL, "prompt": [2**31 - 1], "max_tokens": 1}),
                      path="/v1/completions")
    assert status == 200

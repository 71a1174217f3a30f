"""One path to Redis: gateway/ and scheduler/ reach kvgate's keys only through admission/.

The source of every module under gateway/ and scheduler/ is parsed (ast) and scanned for:

- key names: the key schema's objects (`PoolKeys`, `SchedulerKeys`, `ROOT`, or any import of
  `admission.keys` but `check_name`), a `.keys` attribute that is not a call (a store's
  schema; `dict.keys()` is a call), the schema's key members (`task_key`, `node_reserved`,
  `queues`, ...), and string literals holding the root prefix ``kvg:`` or ``{sched}``;
- Redis commands: a call of any redis-py command or pipeline/pub/sub method (`hgetall`,
  `zcard`, `pipeline`, `execute_command`, `publish`, `subscribe`, `evalsha`, ...), by name
  wherever it appears, and by receiver (`client`, `redis`, `pipe`, `pubsub`) for the few names
  ordinary Python objects share (`get`, `set`, `keys`, ...); an uppercase literal naming a
  command on keys (``"ZMSCORE"``, ``"EVALSHA"``), as raw command calls spell them;
- ending a task: a store's `finish`, `settle` or `cancel` called anywhere but
  gateway/settle.py (`Settler`), the one place a gateway ends a task.

Connection-level commands that touch no key (the multiplexed connection's AUTH and SELECT
handshake, its READONLY reply check) and client lifecycle calls (`aclose`, `close`) are
allowed. The scanner is first run on a sample of each offence, so that a scanner that
stopped seeing one would fail here rather than pass everything.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline, PubSub
from redis.asyncio.cluster import RedisCluster

from admission.keys import ROOT, PoolKeys, SchedulerKeys

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "scheduler")
ENDS_TASKS = "gateway/settle.py"

REDIS_METHODS = frozenset(
    name for cls in (Redis, RedisCluster, Pipeline, PubSub) for name in dir(cls)
    if not name.startswith("_")
)
COMMON_METHODS = frozenset(
    name
    for obj in (dict, list, set, str, bytes, asyncio.Event, asyncio.Future, asyncio.Task,
                asyncio.AbstractEventLoop, logging.Logger, hashlib.sha256())
    for name in dir(obj) if not name.startswith("_")
) | {"close", "aclose", "exists", "reset", "run", "time", "execute", "initialize", "info",
     "digest"}
"""Names that ordinary objects (dicts, sets, events, loggers, paths, clocks) share with
redis-py's commands: a call of one of these is an offence only on a Redis receiver."""
RAW_COMMANDS = REDIS_METHODS - COMMON_METHODS
REDIS_RECEIVERS = frozenset({"client", "redis", "pipe", "pipeline", "pubsub"})
LIFECYCLE = frozenset({"aclose", "close", "initialize"})
CONNECTION_COMMANDS = frozenset({"AUTH", "SELECT", "HELLO", "PING", "QUIT", "READONLY", "INFO"})
"""Uppercase words allowed in literals: connection and server commands on no key (INFO is
also a log level)."""
KEY_MEMBERS = frozenset(
    name for cls in (PoolKeys, SchedulerKeys) for name in dir(cls) if not name.startswith("_")
) - {"pool", "state", "stats", "clock", "running", "queue", "epoch", "leader", "wake_channel"}
"""The schema's members whose names say 'key'; the generic words (a result's `state`, the
service's `clock`, ...) are caught through the `.keys` attribute they are reached by.
`wake_channel` is also `PoolStore`'s, which takes it from the schema."""
KEY_MODULE_ALLOWED = frozenset({"check_name"})
PREFIXES = (f"{ROOT}:", "{sched}")


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return "?"


def _last(dotted: str) -> str:
    return dotted.rsplit(".", 1)[-1].lstrip("_")


def offences(source: str, path: str) -> Iterator[str]:
    """Every way `source` (the module at `path`) reaches Redis keys other than through
    admission/, one line each."""
    tree = ast.parse(source, filename=path)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module == "admission.keys":
            for alias in node.names:
                if alias.name not in KEY_MODULE_ALLOWED:
                    yield f"{where}: imports the key schema's {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "admission.keys":
                    yield f"{where}: imports the key schema"
        elif isinstance(node, ast.Name) and node.id in ("PoolKeys", "SchedulerKeys", "ROOT"):
            yield f"{where}: names the key schema ({node.id})"
        elif isinstance(node, ast.Attribute):
            if node.attr == "keys" and id(node) not in called:
                yield f"{where}: reads a key schema ({_dotted(node)})"
            elif node.attr in KEY_MEMBERS:
                yield f"{where}: names a key ({_dotted(node)})"
            if id(node) in called:
                receiver = _last(_dotted(node.value))
                on_redis = (receiver in REDIS_RECEIVERS and node.attr in REDIS_METHODS
                            and node.attr not in LIFECYCLE)
                if node.attr in RAW_COMMANDS or on_redis:
                    yield f"{where}: calls Redis ({_dotted(node)})"
                elif (node.attr in ("finish", "settle", "cancel") and receiver.endswith("store")
                      and path != ENDS_TASKS):
                    yield f"{where}: ends a task outside {ENDS_TASKS} ({_dotted(node)})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if any(prefix in text for prefix in PREFIXES):
                yield f"{where}: names a key ({text!r})"
            elif (text.isupper() and text.isalpha() and text.lower() in REDIS_METHODS
                  and text not in CONNECTION_COMMANDS):
                yield f"{where}: spells a Redis command ({text!r})"


def service_modules() -> Iterator[Path]:
    for package in SERVICES:
        yield from sorted((REPO / package).rglob("*.py"))


def test_the_scanner_sees_each_offence() -> None:
    samples = {
        "from admission.keys import PoolKeys": "imports the key schema's PoolKeys",
        "import admission.keys": "imports the key schema",
        "k = SchedulerKeys().leader": "names the key schema (SchedulerKeys)",
        "q = store.keys.queue(t)": "reads a key schema (store.keys)",
        "k = keys.task_key(i)": "names a key (keys.task_key)",
        "k = f'kvg:{{{p}}}:state'": "names a key ('kvg:{')",
        "h = 'kvg:{p}:task:1'": "names a key ('kvg:{p}:task:1')",
        "await store.client.hgetall(k)": "calls Redis (store.client.hgetall)",
        "p = client.pipeline(transaction=False)": "calls Redis (client.pipeline)",
        "pipe.zcard(q)": "calls Redis (pipe.zcard)",
        "await self.client.publish(c, m)": "calls Redis (self.client.publish)",
        "await gw.redis.get(k)": "calls Redis (gw.redis.get)",
        "await c.execute_command('ZMSCORE', q, i)": "calls Redis (c.execute_command)",
        "await mux.execute('EVALSHA', sha, 0)": "spells a Redis command ('EVALSHA')",
        "self.settler_store.cancel(t)": "ends a task outside gateway/settle.py",
        "await pool.store.finish(t, None, cancelled=True)": "ends a task outside",
    }
    for source, expected in samples.items():
        found = list(offences(source, "gateway/sample.py"))
        assert any(expected in line for line in found), (source, found)
    clean = "\n".join([
        "d = {}.keys()", "v = d.get('x')", "s.discard(1)", "await client.aclose()",
        "await store.admit(task_id=t)", "c = store.wake_channel(g)",
        "await mux.execute('AUTH', pw)", "level = 'INFO'", "zone = 'RED'",
        "self.settler.finish(store, t, None, cancelled=True, labels=None)",
    ])
    assert list(offences(clean, "gateway/sample.py")) == []
    assert list(offences("await store.finish(t, 5, cancelled=False)", ENDS_TASKS)) == []


def test_gateway_and_scheduler_reach_redis_keys_only_through_admission() -> None:
    modules = list(service_modules())
    assert len(modules) > 20 and any(p.name == "waiter.py" for p in modules)
    found = [line for path in modules
             for line in offences(path.read_text(encoding="utf-8"),
                                  str(path.relative_to(REPO)))]
    assert found == [], "gateway/ or scheduler/ bypass admission/:\n" + "\n".join(found)

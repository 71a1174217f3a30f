"""The Lua scripts, loaded once as package data, and the one way they are run.

Each script is the library files (`LIBRARY`, in that order: each uses only what the ones
before it define) followed by its own file. A `Script` runs EVALSHA and, on NOSCRIPT,
SCRIPT LOAD + EVALSHA once more, so a Redis restart, a failover or a `SCRIPT FLUSH` costs one
extra round trip, never an error. Every script call of the project goes through
`Script.__call__`, whatever carries it: a redis-py client (`redis.asyncio.Redis`,
`RedisCluster`), or the gateway's multiplexed connection through `CommandTransport`; both
offer the two commands a `ScriptTransport` needs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Protocol

from redis.exceptions import NoScriptError

SCRIPT_NAMES = ("admit", "release", "finish", "renew", "reap", "state", "leader", "abandon", "hint",
                "forget")
LIBRARY = ("_lib", "_quota", "_room", "_place", "_tenant", "_task")
"""The helpers every script starts with: units, key names, clocks and token buckets; quota
levels; placement and the prefill room; per-tenant accounting and fair release; the end of a
task and the fencing epoch."""


_test_clock = False


def allow_frozen_clock() -> None:
    """Let this process's scripts, and its reads of Redis time, honour the pool clock's
    ``frozen_us`` field, so that tests can stop and move time without sleeping.

    Off in every service: no configuration, environment variable or command line reaches it,
    only a call from Python (the test suite's conftest makes it). Off, the scripts never read
    the field (it is compiled out, below) and the readers in `admission.reads` and
    `admission.inspect` do not fetch it, so a stray ``frozen_us`` in a production Redis changes
    nothing."""
    global _test_clock
    _test_clock = True


def frozen_clock_allowed() -> bool:
    """Whether `allow_frozen_clock` was called in this process."""
    return _test_clock


@cache
def script_source(name: str, test_clock: bool = False) -> str:
    """The library files and the script, after one line that says whether the clock may be
    frozen (``TEST_CLOCK``, read by `now_us` in `_lib.lua`): the two variants have different SHAs,
    so a service never runs a test's script by accident."""
    package = resources.files("lua")
    lib = "\n".join(package.joinpath(f"{part}.lua").read_text(encoding="utf-8")
                    for part in LIBRARY)
    body = package.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    flag = "local TEST_CLOCK = " + ("true" if test_clock else "false") + "\n"
    return flag + lib + "\n" + body


class ScriptTransport(Protocol):
    """What carries script calls: redis-py's clients have both methods with these signatures."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]: ...

    def script_load(self, script: str) -> Awaitable[Any]: ...


class Script:
    """One script bound to a transport: EVALSHA, with one SCRIPT LOAD and retry on NOSCRIPT."""

    __slots__ = ("name", "script", "sha", "transport")

    def __init__(self, name: str, source: str, transport: Any) -> None:
        self.name = name
        self.script = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        self.transport: ScriptTransport = transport

    def via(self, transport: Any) -> Script:
        """The same script, carried by `transport`."""
        return Script(self.name, self.script, transport)

    async def __call__(self, keys: Sequence[str] = (), args: Iterable[Any] = ()) -> Any:
        transport = self.transport
        keys_and_args = (*keys, *args)
        try:
            return await transport.evalsha(self.sha, len(keys), *keys_and_args)
        except NoScriptError:
            # The script cache was flushed (restart, failover, SCRIPT FLUSH): load, retry once.
            sha = await transport.script_load(self.script)
            self.sha = sha.decode() if isinstance(sha, bytes) else str(sha)
            return await transport.evalsha(self.sha, len(keys), *keys_and_args)


@dataclass(frozen=True, slots=True)
class Scripts:
    admit: Script
    release: Script
    finish: Script
    renew: Script
    reap: Script
    state: Script
    leader: Script
    abandon: Script
    hint: Script
    forget: Script

    def all(self) -> tuple[Script, ...]:
        return tuple(getattr(self, name) for name in SCRIPT_NAMES)

    def via(self, transport: Any) -> Scripts:
        """The same scripts, carried by `transport`."""
        return Scripts(**{s.name: s.via(transport) for s in self.all()})

    def via_connection(self, connection: Any) -> Scripts:
        """The same scripts, carried by a connection that executes raw commands (the
        gateway's multiplexed connection: `CommandTransport`)."""
        return self.via(CommandTransport(connection))


class CommandTransport:
    """A `ScriptTransport` over a connection that only executes raw commands
    (`await connection.execute(*args)`), such as the gateway's multiplexed connection."""

    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    # Plain functions returning the connection's awaitable: no coroutine frame of their own
    # on the hot path's two calls per request.
    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]:
        reply: Awaitable[Any] = self.connection.execute("EVALSHA", sha, numkeys, *keys_and_args)
        return reply

    def script_load(self, script: str) -> Awaitable[Any]:
        reply: Awaitable[Any] = self.connection.execute("SCRIPT", "LOAD", script)
        return reply


def register_scripts(client: Any) -> Scripts:
    """Bind every script to `client` (redis.asyncio.Redis or RedisCluster); no I/O."""
    return Scripts(**{name: Script(name, script_source(name, _test_clock), client)
                      for name in SCRIPT_NAMES})


async def load_scripts(client: Any, scripts: Scripts) -> None:
    """Load every script now (readiness), instead of on first use."""
    for script in scripts.all():
        script.sha = await client.script_load(script.script)


async def ensure_ready(client: Any, scripts: Scripts) -> None:
    """Redis answers and holds every script (loading those it lost); raises when it cannot.
    SCRIPT EXISTS is the check that it answers (a PING first was one more round trip)."""
    present = await client.script_exists(*(s.sha for s in scripts.all()))
    if not all(present):
        await load_scripts(client, scripts)

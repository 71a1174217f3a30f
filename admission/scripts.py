"""The Lua scripts, loaded once as package data and registered with a client.

Each script is `_lib.lua` followed by its own file. redis-py's `AsyncScript` runs EVALSHA and
falls back to SCRIPT LOAD + EVALSHA on NOSCRIPT, so a Redis restart, a failover or a
`SCRIPT FLUSH` costs one extra round trip, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.commands.core import AsyncScript

SCRIPT_NAMES = ("admit", "release", "finish", "renew", "reap", "state", "leader", "abandon", "hint")


@cache
def script_source(name: str) -> str:
    package = resources.files("lua")
    lib = package.joinpath("_lib.lua").read_text(encoding="utf-8")
    body = package.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return lib + "\n" + body


@dataclass(frozen=True, slots=True)
class Scripts:
    admit: AsyncScript
    release: AsyncScript
    finish: AsyncScript
    renew: AsyncScript
    reap: AsyncScript
    state: AsyncScript
    leader: AsyncScript
    abandon: AsyncScript
    hint: AsyncScript

    def all(self) -> tuple[AsyncScript, ...]:
        return tuple(getattr(self, name) for name in SCRIPT_NAMES)


def register_scripts(client: Any) -> Scripts:
    """Bind every script to `client` (redis.asyncio.Redis or RedisCluster); no I/O."""
    return Scripts(**{name: client.register_script(script_source(name)) for name in SCRIPT_NAMES})


async def load_scripts(client: Any, scripts: Scripts) -> None:
    """Load every script now (readiness), instead of on first use."""
    for script in scripts.all():
        script.sha = await client.script_load(script.script)

"""The redis-cli commands of docs/runbook.md ("Your tools") work as written against a Redis the
admission scripts populated, and the hash fields their comments list are fields those scripts
and the leader really write.

The block is read out of the runbook: each `redis-cli ...` line runs through the real
`redis-cli` against the session's private redis-server (the pool `llama-8b` and the `<...>`
placeholders replaced by names that exist there). A comment that is a plain list of field
names (parentheses aside) is checked field by field against the hash read after the command:
`name_0..2` stands for three fields, and a placeholder such as `<node>` or `<tier>` is replaced
by the value an operator would type (a node's name; a tier's name, vip, normal or batch).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from admission.tiers import Tier
from tests.test_inspect import ETL, POOL, T0, S, World, populate

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "runbook.md"

PLACEHOLDERS = {"llama-8b": POOL, "<id>": "c", "<tenant>": "acme", "<gateway-id>": "gw-2",
                "<node>": "gpu-0"}
TIER_NAMES = tuple(t.label for t in Tier)
ONLY_SOMETIMES = {
    "red_clear_s": "the leader writes it only while the pool is RED",
}
FIELD = re.compile(r"^[a-z][a-z0-9_]*(?::<[a-z-]+>|_<[a-z-]+>|_\d\.\.\d)?$")


def runbook_commands() -> list[tuple[str, str]]:
    """(command, comment) of every redis-cli line of the tools' console block."""
    text = RUNBOOK.read_text(encoding="utf-8")
    block = text.split("- **redis-cli.**", 1)[1].split("```console", 1)[1].split("```", 1)[0]
    out = []
    for line in block.strip().splitlines():
        command, _, comment = line.strip().partition("#")
        assert command.startswith("redis-cli "), line
        out.append((command.strip(), comment.strip()))
    return out


def documented_fields(comment: str) -> list[str] | None:
    """The fields a comment lists, or None when it is prose."""
    items = [i.strip() for i in re.sub(r"\s*\([^)]*\)", "", comment).split(",")]
    if not items or not all(FIELD.match(i) for i in items):
        return None
    fields: list[str] = []
    for item in items:
        if m := re.fullmatch(r"(.*_)(\d)\.\.(\d)", item):
            fields += [f"{m[1]}{n}" for n in range(int(m[2]), int(m[3]) + 1)]
        elif "_<tier>" in item:
            fields += [item.replace("<tier>", name) for name in TIER_NAMES]
        else:
            for placeholder, value in PLACEHOLDERS.items():
                item = item.replace(placeholder, value)
            fields.append(item)
    return fields


def redis_cli(port: int, command: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    args = shlex.split(command)
    result = subprocess.run([args[0], "-p", str(port), *args[1:]], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, (command, result.stderr)
    assert not re.match(r"(ERR|WRONGTYPE|\(error\))", result.stdout), (command, result.stdout)
    return result.stdout


def test_the_block_is_read_and_field_lists_are_told_from_prose() -> None:
    commands = runbook_commands()
    assert len(commands) >= 10
    assert documented_fields("micro_tokens, updated_us, rate, burst") == [
        "micro_tokens", "updated_us", "rate", "burst"]
    assert documented_fields("drain_0..2, usage:<node>") == [
        "drain_0", "drain_1", "drain_2", "usage:gpu-0"]
    assert documented_fields("budget per node (tokens), written by the leader") is None
    assert documented_fields("gateway -> lease expiry µs") is None


async def _states_an_operator_meets(client: aioredis.Redis, port: int,
                                    commands: list[tuple[str, str]]) -> dict[str, set[str]]:
    """Run every command in two states of one pool: busy (a task in flight, Batch queued) and
    after the reaper ended tasks; the fields seen per key over both."""
    w: World = await populate(client)
    # A Batch task of a live gateway whose queue deadline passes: the reaper expires it.
    admitted = await w.store.admit(task_id="e", tenant=ETL, tier=Tier.BATCH, prompt_tokens=10,
                                   max_tokens=10, gateway="gw-3", queue_timeout_ms=1_000)
    assert admitted.outcome.value == "queued"
    released = await w.store.release(w.epoch, (0, 0, 1))  # a Batch release too
    assert [t.task_id for t in released if t.node] == ["c"]
    seen: dict[str, set[str]] = {}

    async def run_all() -> None:
        for command, _ in commands:
            redis_cli(port, command)
            args = shlex.split(command.replace("llama-8b", POOL))
            if args[1] == "HGETALL":
                for placeholder, value in PLACEHOLDERS.items():
                    args[2] = args[2].replace(placeholder, value)
                fields = {k.decode() if isinstance(k, bytes) else k
                          for k in await client.hkeys(args[2])}
                seen.setdefault(command, set()).update(fields)

    await run_all()
    await w.at(T0 + 7 * S)  # e's deadline passed, gw-3's lease holds
    assert (await w.store.reap(100)).expired == 1
    await w.at(T0 + 30 * S)  # gw-1's and gw-2's leases expired
    assert (await w.store.reap(100)).reaped >= 1
    await run_all()
    return seen


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
async def test_every_redis_cli_command_runs_and_names_real_fields(
    redis_client: aioredis.Redis,
) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    commands = runbook_commands()
    seen = await _states_an_operator_meets(redis_client, port, commands)
    wrong = []
    for command, comment in commands:
        if command.split()[1] != "HGETALL":
            continue
        assert seen[command], f"{command}: the hash is empty in both states"
        for field in documented_fields(comment) or ():
            if field not in seen[command] and field not in ONLY_SOMETIMES:
                wrong.append(f"{command}: no field {field!r} (has {sorted(seen[command])})")
    assert not wrong, "\n".join(wrong)

"""``kvgate-prune``: delete the keys of tenants and teams the configuration no longer names.

A tenant's token bucket and fairness hash (``kvg:{pool}:bucket:<tenant>``,
``kvg:{pool}:tenant:<tenant>``) and a team's quota hash (``kvg:{pool}:quota:<team>``) have no
TTL: a bucket must outlive any idle time (it refills to its burst, and a shorter life would
hand a tenant a full bucket early), and a team's hash holds the day's and the month's
allowances. So removing a tenant or a team from the configuration leaves its keys, and
`kvgate-inspect` keeps listing them. This command finds, in each pool, the tenants and teams
with keys in Redis that the file given with ``--config`` does not define, and deletes their
keys, one name at a time with `lua/forget.lua`, which keeps a name that still has anything
alive (a task queued or in flight, tokens held by a live task), whose bucket or allowance is
spent (below its burst, or used in the current day or month: deleted, a tenant configured
again would find them fresh; ``--spent`` deletes those too), or that was written less than
``--min-idle`` ago (a gateway still admitting for it: a rolling update not yet done). Without
``--apply`` it only says what it would delete.

A pool the file no longer configures (a model taken out of service) is named on stderr; named
with ``--pool`` and ``--retired-pools``, it is judged and deleted whole (`admission.retire`:
kept while the schedulers' leader publishes it, a gateway's lease there is unexpired, it was
written less than ``--min-idle`` ago, and never less than an hour, or, unless ``--spent``, a
bucket of it is spent).

The file must name every tenant and team that any gateway using these pools has: what it
defines is kept, and a name another deployment serves on the same pool would be judged as
removed (the idle time guards it only while its requests pass: a refused request writes
nothing). A file that defines no tenant (the schedulers' configuration, which holds none) is
refused rather than read as "every tenant was removed". In the Helm chart the gateways' file
is joined from the ConfigMap and the tenants Secret at start; run the command in a gateway
pod, against that joined file. Its script deletes keys: the Redis user needs ``DEL`` within
scripts besides ``SCAN`` and ``EVALSHA``.

A name that comes back starts afresh: a full bucket, unused allowances (which is why spent
ones are kept), and fairness counters at the tier's floor, as any new tenant's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from redis.exceptions import NoPermissionError

from admission.config import ConfigError
from admission.connection import connect
from admission.errors import REDIS_ERRORS
from admission.inspect import (
    EXIT_CONFIG,
    EXIT_NOTHING,
    EXIT_REDIS,
    pool_argument,
    run_cli,
    write_stdout,
)
from admission.inspect_fair import as_text
from admission.inspect_target import (
    SCAN_COUNT,
    check_ca,
    choose_pools,
    discover_pools,
    pool_pattern,
    resolve_target,
)
from admission.keys import NAME_PATTERN
from admission.retire import POOL_MIN_IDLE_S, judge_pool
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore

DEFAULT_MIN_IDLE_S = 86_400.0
"""Keys written less than a day ago are kept: longer than any rolling update, and a name in use
by some gateway writes its bucket at every admit."""


MAX_MIN_IDLE_S = 10 * 365 * 86_400.0
"""The longest --min-idle taken (ten years): far past any key's age, and exact in µs."""


@dataclass(frozen=True, slots=True)
class Verdict:
    pool: str
    kind: str
    """'tenant', 'team' or 'pool' (a retired one, judged whole)."""
    name: str
    verdict: str
    """'forgotten' (deleted), 'forgettable' (would be, with --apply) or 'kept'."""
    reason: str
    """Why kept: 'queued', 'in_flight', 'held', 'wrong_type', 'spent', 'recent' or 'absent'
    (gone meanwhile); for a pool, 'leased' (a gateway holds work there), 'recent' or
    'spent'."""
    idle_s: float | None
    """Seconds since the keys' last recorded write (None: they record none)."""
    keys: int


async def names_by_prefix(client: Any, pool: str, prefixes: Sequence[str],
                          foreign: set[str]) -> dict[str, set[str]]:
    """The names after each of `prefixes` of the pool's keys that start with it, from one
    SCAN of the pool's keys (one pass over the keyspace, not one per prefix); the key of a
    name that is no valid tenant or team name (written by hand) goes to `foreign`, never to a
    script."""
    found: dict[str, set[str]] = {prefix: set() for prefix in prefixes}
    async for raw in client.scan_iter(match=pool_pattern(pool), count=SCAN_COUNT):
        key = as_text(raw)
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            continue
        if NAME_PATTERN.fullmatch(key[len(prefix):]):
            found[prefix].add(key[len(prefix):])
        else:
            foreign.add(key)
    return found


async def prune_pool(store: PoolStore, tenants: set[str], teams: set[str], args: Any,
                     out: list[Verdict], foreign: set[str]) -> None:
    """Judge (and with `args.apply`, forget) every tenant and team of the store's pool with
    keys in Redis that is not in `tenants` or `teams`, appending each verdict to `out` as it
    is made (a run that fails part way still reports what it deleted)."""
    keys = store.keys
    bucket, record, quota = keys.bucket_key(""), keys.tenant_key(""), keys.quota_key("")
    found = await names_by_prefix(store.client, store.pool, (bucket, record, quota), foreign)
    stale_tenants = (found[bucket] | found[record]) - tenants
    stale_teams = found[quota] - teams
    for kind, names in (("tenant", stale_tenants), ("team", stale_teams)):
        for name in sorted(names):
            got = await store.forget("tenant" if kind == "tenant" else "level", name,
                                     int(args.min_idle * 1_000_000), args.apply, args.spent)
            out.append(Verdict(store.pool, kind, name, got.verdict, got.reason,
                               None if got.idle_us is None else got.idle_us / 1e6, got.keys))


def idle_argument(text: str) -> float:
    """--min-idle's argparse type: finite seconds from 0 to `MAX_MIN_IDLE_S`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_MIN_IDLE_S):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_MIN_IDLE_S:.0f}, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvgate-prune", description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit status: 0: judged (and with --apply, deleted), whatever was kept; "
               f"{EXIT_REDIS}: Redis unreachable or failing (what was judged before is "
               f"printed); {EXIT_CONFIG}: bad flags or configuration; {EXIT_NOTHING}: Redis "
               "holds no kvgate key of those pools.")
    parser.add_argument("--config", required=True,
                        help="the gateways' TOML file, with their [[tenants]] and [[teams]]: "
                             "what it defines is kept (REDIS_URL overrides its redis.url)")
    parser.add_argument("--pool", action="append", default=[], type=pool_argument,
                        help="pool to prune (repeatable; default: the file's pools; a pool "
                             "no longer in the file is pruned only when named)")
    parser.add_argument("--ssl-ca-file", help="CA bundle instead of the file's redis.ssl_ca_file")
    parser.add_argument("--min-idle", type=idle_argument, default=DEFAULT_MIN_IDLE_S,
                        metavar="SECONDS",
                        help="keep keys written less than SECONDS ago (default: one day)")
    parser.add_argument("--spent", action="store_true",
                        help="also delete a spent bucket or allowance (a tenant or team "
                             "configured again would then find it fresh)")
    parser.add_argument("--retired-pools", action="store_true",
                        help="judge, and with --apply delete whole, the pools named with "
                             "--pool that the file does not configure (admission.retire)")
    parser.add_argument("--apply", action="store_true",
                        help="delete; without it, only say what would be deleted")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    if args.retired_pools and not args.pool:
        parser.error("--retired-pools: name the pools to retire with --pool (a whole pool "
                     "goes only when named)")
    return args


def _say(message: str) -> None:
    print(f"kvgate-prune: {message}", file=sys.stderr, flush=True)


def idle_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size, below in (("s", 1, 120), ("min", 60, 3_600), ("h", 3_600, 3 * 86_400)):
        if seconds < below:
            return f"{seconds / size:.0f} {unit}" if unit == "s" else f"{seconds / size:.1f} {unit}"
    return f"{seconds / 86_400:.1f} d"


def render(verdicts: Sequence[Verdict], apply: bool) -> str:
    if not verdicts:
        return "nothing to prune: every tenant and team with keys is in the configuration\n"
    rows = [("pool", "kind", "name", "verdict", "idle", "keys")]
    for v in verdicts:
        what = v.verdict + (f" ({v.reason})" if v.reason else "")
        rows.append((v.pool, v.kind, v.name, what, idle_text(v.idle_s), str(v.keys)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    done = sum(v.verdict == "forgotten" for v in verdicts)
    would = sum(v.verdict == "forgettable" for v in verdicts)
    kept = sum(v.verdict == "kept" for v in verdicts)
    lines.append(f"{done} deleted, {kept} kept" if apply else
                 f"{would} would be deleted with --apply, {kept} kept")
    return "\n".join(lines) + "\n"


def _unsure(args: argparse.Namespace) -> str:
    """What a run that stopped part way cannot say: a deletion whose reply was lost."""
    return ("; the name being judged then may have been deleted without a reply: run again "
            "to see what is left" if args.apply else "")


def _refusal(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    # Outside a script an ACL refusal is a NoPermissionError; inside one, an error reply that
    # says so in words, which differ between Redis versions.
    lowered = text.lower()
    if isinstance(exc, NoPermissionError) or any(
            words in lowered for words in ("noperm", "user executing", "acl failure",
                                           "no permissions")):
        text += (" (the Redis user needs SCAN, HGETALL, HGET, ZRANGE, TIME and EVALSHA, and "
                 "within scripts TYPE and DEL; UNLINK for --retired-pools. The gateways' own "
                 "scripts never delete a key, so their user may lack DEL)")
    return text


async def run(args: argparse.Namespace, env: Mapping[str, str],
              write: Callable[[str], object] = write_stdout) -> int:
    target = resolve_target(config=args.config, redis_url=None, cluster=False,
                            ssl_ca_file=args.ssl_ca_file, pools=args.pool, env=env)
    if not target.tenants:
        raise ConfigError(
            f"{args.config} defines no [[tenants]]: every tenant would count as removed. Name "
            "the gateways' file with their tenants (in the Helm chart, the file joined in a "
            "gateway pod)")
    _say(f"{target.announce()}; keeping what {args.config} defines (tenants: "
         f"{len(target.tenants)}, teams: {len(target.teams)})")
    check_ca(target)
    client = connect(target.settings)
    scripts = register_scripts(client)
    verdicts: list[Verdict] = []
    foreign: set[str] = set()
    code = 0
    try:
        pools = await choose_pools(client, target, _say)
        configured = set(target.configured_pools)
        for pool in pools:
            if pool not in configured:
                continue  # named with --pool: judged whole below
            await prune_pool(PoolStore(client, scripts, pool, PoolPolicy()),
                             {t.name for t in target.tenants}, set(target.teams), args,
                             verdicts, foreign)
        # A whole pool goes only when named: pools found in Redis and not in the file are
        # listed, never judged unasked.
        named = [p for p in pools if p not in configured] if args.pool else []
        unnamed = [p for p in await discover_pools(client)
                   if p not in configured and p not in named]
        if unnamed:
            _say(f"pools in Redis that {args.config} does not configure: {', '.join(unnamed)} "
                 "(name one with --pool and --retired-pools to judge it whole)")
        for pool in named if args.retired_pools else ():
            got = await judge_pool(client, pool, int(max(args.min_idle, POOL_MIN_IDLE_S)
                                                      * 1_000_000), args.spent, args.apply)
            verdicts.append(Verdict(pool, "pool", pool, got.verdict, got.reason,
                                    None if got.idle_us is None else got.idle_us / 1e6,
                                    got.keys))
    except REDIS_ERRORS as exc:
        if not verdicts:
            _say(f"cannot use Redis at {target.address}: {_refusal(exc)}{_unsure(args)}")
            return EXIT_REDIS
        # What was deleted before the failure is said, not lost with it.
        _say(f"stopped after {len(verdicts)} names: Redis at {target.address}: "
             f"{_refusal(exc)}{_unsure(args)}")
        code = EXIT_REDIS
    except (KeyboardInterrupt, asyncio.CancelledError):
        _say(f"interrupted after {len(verdicts)} names{_unsure(args)}")
        code = 130
    finally:
        await client.aclose()
    if foreign:
        _say(f"left alone {len(foreign)} keys whose name is no tenant's or team's (written by "
             f"hand?): {', '.join(repr(k) for k in sorted(foreign)[:5])}")
    write(json.dumps({"applied": args.apply, "verdicts": [asdict(v) for v in verdicts],
                      "foreign_keys": sorted(foreign), "complete": code == 0}) + "\n"
          if args.json else render(verdicts, args.apply))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: run(args, os.environ), _say)


if __name__ == "__main__":
    sys.exit(main())

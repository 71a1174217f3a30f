"""``kvgate-prune``: delete the keys of tenants and teams the configuration no longer names.

A tenant's token bucket and fairness hash (``kvg:{pool}:bucket:<tenant>``,
``kvg:{pool}:tenant:<tenant>``) and a team's quota hash (``kvg:{pool}:quota:<team>``) have no
TTL: a bucket must outlive any idle time (it refills to its burst, and a shorter life would
hand a tenant a full bucket early), and a team's hash holds the day's and the month's
allowances. So removing a tenant or a team from the configuration leaves its keys, and
`kvgate-inspect` keeps listing them. This command finds, in each pool, the tenants and teams
with keys in Redis that the file given with ``--config`` does not define, and deletes their
keys, one name at a time with `lua/forget.lua`, which keeps a name that still has anything
alive (a task queued or in flight, tokens held by a live task) or that was written less than
``--min-idle`` ago (a gateway that still has it configured: a rolling update not yet done,
another deployment on the same pool). Without ``--apply`` it only says what it would delete.

The file must be the gateways' own, with their tenants: the tenants it defines are what is
kept. A file that defines none (the schedulers' configuration, which holds no tenants) is
refused rather than read as "every tenant was removed". In the Helm chart the gateways' file
is joined from the ConfigMap and the tenants Secret at start; run the command in a gateway
pod, against that joined file.

A name that comes back (the tenant is configured again) starts afresh: a full bucket, no
fairness history, and a team's allowances of the day and the month unused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from admission.config import ConfigError
from admission.connection import connect
from admission.errors import REDIS_ERRORS
from admission.inspect import (
    EXIT_CONFIG,
    EXIT_NOTHING,
    EXIT_REDIS,
    seconds_argument,
)
from admission.inspect_fair import as_text
from admission.inspect_target import (
    SCAN_COUNT,
    NothingFound,
    check_ca,
    choose_pools,
    resolve_target,
)
from admission.keys import NAME_PATTERN, check_name
from admission.scripts import register_scripts
from admission.store import PoolPolicy, PoolStore

DEFAULT_MIN_IDLE_S = 86_400.0
"""Keys written less than a day ago are kept: longer than any rolling update, and a name in use
by some gateway writes its bucket at every admit."""


@dataclass(frozen=True, slots=True)
class Verdict:
    pool: str
    kind: str
    """'tenant' or 'team'."""
    name: str
    verdict: str
    """'forgotten' (deleted), 'forgettable' (would be, with --apply) or 'kept'."""
    reason: str
    """Why kept: 'queued', 'in_flight', 'held', 'recent' or 'absent' (gone meanwhile)."""
    idle_s: float | None
    """Seconds since the keys' last recorded write (None: they record none)."""
    keys: int


async def names_under(client: Any, prefix: str, foreign: set[str]) -> set[str]:
    """The names after `prefix` of the keys that start with it (one SCAN); a name that is no
    valid tenant or team name (a key written by hand) goes to `foreign`, never to a script."""
    found: set[str] = set()
    async for raw in client.scan_iter(match=prefix + "*", count=SCAN_COUNT):
        name = as_text(raw)[len(prefix):]
        (found if NAME_PATTERN.fullmatch(name) else foreign).add(name)
    return found


async def prune_pool(store: PoolStore, tenants: set[str], teams: set[str], min_idle_s: float,
                     apply: bool, foreign: set[str]) -> list[Verdict]:
    """Judge (and with `apply`, forget) every tenant and team of the store's pool with keys in
    Redis that is not in `tenants` or `teams`."""
    keys, client = store.keys, store.client
    stale_tenants = (await names_under(client, keys.bucket_key(""), foreign)
                     | await names_under(client, keys.tenant_key(""), foreign)) - tenants
    stale_teams = await names_under(client, keys.quota_key(""), foreign) - teams
    out = []
    for kind, names in (("tenant", stale_tenants), ("team", stale_teams)):
        for name in sorted(names):
            got = await store.forget("tenant" if kind == "tenant" else "level", name,
                                     int(min_idle_s * 1_000_000), apply)
            out.append(Verdict(store.pool, kind, name, got.verdict, got.reason,
                               None if got.idle_us is None else got.idle_us / 1e6, got.keys))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvgate-prune", description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit status: 0: judged (and with --apply, deleted); {EXIT_REDIS}: Redis "
               f"unreachable or failing; {EXIT_CONFIG}: bad flags or configuration; "
               f"{EXIT_NOTHING}: Redis holds no kvgate key of those pools.")
    parser.add_argument("--config", required=True,
                        help="the gateways' TOML file, with their [[tenants]] and [[teams]]: "
                             "what it defines is kept (REDIS_URL overrides its redis.url)")
    parser.add_argument("--pool", action="append", default=[],
                        help="pool to prune (repeatable; default: the file's pools)")
    parser.add_argument("--ssl-ca-file", help="CA bundle instead of the file's redis.ssl_ca_file")
    parser.add_argument("--min-idle", type=seconds_argument, default=DEFAULT_MIN_IDLE_S,
                        metavar="SECONDS",
                        help="keep keys written less than SECONDS ago (default: one day)")
    parser.add_argument("--apply", action="store_true",
                        help="delete; without it, only say what would be deleted")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    for pool in args.pool:
        try:
            check_name("pool", pool)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def _say(message: str) -> None:
    print(f"kvgate-prune: {message}", file=sys.stderr, flush=True)


def render(verdicts: Sequence[Verdict], apply: bool) -> str:
    if not verdicts:
        return "nothing to prune: every tenant and team with keys is in the configuration\n"
    rows = [("pool", "kind", "name", "verdict", "idle", "keys")]
    for v in verdicts:
        idle = ("-" if v.idle_s is None else f"{v.idle_s / 3600:.1f} h"
                if v.idle_s < 3 * 86_400 else f"{v.idle_s / 86_400:.1f} d")
        what = v.verdict + (f" ({v.reason})" if v.reason else "")
        rows.append((v.pool, v.kind, v.name, what, idle, str(v.keys)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    done = sum(v.verdict == "forgotten" for v in verdicts)
    would = sum(v.verdict == "forgettable" for v in verdicts)
    kept = sum(v.verdict == "kept" for v in verdicts)
    lines.append(f"{done} deleted, {kept} kept" if apply else
                 f"{would} would be deleted with --apply, {kept} kept")
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace, env: Mapping[str, str],
              write: Callable[[str], object] = sys.stdout.write) -> int:
    target = resolve_target(config=args.config, redis_url=None, cluster=False,
                            ssl_ca_file=args.ssl_ca_file, pools=args.pool, env=env)
    if not target.tenants:
        raise ConfigError(
            f"{args.config} defines no [[tenants]]: every tenant would count as removed. Name "
            "the gateways' file with their tenants (in the Helm chart, the file joined in a "
            "gateway pod)")
    _say(f"{target.announce()}; keeping the {len(target.tenants)} tenants and "
         f"{len(target.teams)} teams of {args.config}")
    check_ca(target)
    client = connect(target.settings)
    scripts = register_scripts(client)
    try:
        pools = await choose_pools(client, target, _say)
        foreign: set[str] = set()
        verdicts: list[Verdict] = []
        for pool in pools:
            verdicts += await prune_pool(
                PoolStore(client, scripts, pool, PoolPolicy()),
                {t.name for t in target.tenants}, set(target.teams), args.min_idle,
                args.apply, foreign)
    except REDIS_ERRORS as exc:
        _say(f"cannot use Redis at {target.address}: {exc or type(exc).__name__}")
        return EXIT_REDIS
    finally:
        await client.aclose()
    if foreign:
        _say(f"left alone {len(foreign)} keys whose name is no tenant's or team's (written by "
             f"hand?): {', '.join(repr(n) for n in sorted(foreign)[:5])}")
    out = (json.dumps({"applied": args.apply, "verdicts": [asdict(v) for v in verdicts]})
           + "\n") if args.json else render(verdicts, args.apply)
    write(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args, os.environ))
    except ConfigError as exc:
        _say(str(exc))
        return EXIT_CONFIG
    except NothingFound as exc:
        _say(str(exc))
        return EXIT_NOTHING
    except OSError as exc:  # the config file or the CA
        _say(str(exc))
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

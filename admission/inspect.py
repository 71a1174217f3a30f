"""``python -m admission.inspect``: what Redis says about every model pool, right now.

Per pool: the zone the leader published and how old that is, the nodes with each tier's budget,
reservations, headroom and measured usage, queue depth and oldest wait per tier, the
reservations in flight, the gateways' leases, and every tenant's token bucket; plus who leads
the schedulers. Plain tables by default, ``--json`` for machines, ``--watch`` to refresh. It
only reads, one consistent snapshot per pool (`admission.inspect_read` says how), on the clock
the Lua scripts use, so waits, ages and bucket refills shown are the ones the next admit would
compute, whatever this machine's clock says.

Which Redis it reads is found as the services find theirs (`admission.inspect_target`) and
named on stderr before the first read, without credentials. A Redis that cannot be reached
(connect and read timeouts of ``[redis]``, 500 ms by default) exits 1 with the client's
message; one that holds no key of the pools asked for exits 3 naming the key pattern: an empty
table from the wrong server would look like an idle deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from admission.config import ConfigError
from admission.connection import connect
from admission.errors import REDIS_ERRORS
from admission.inspect_read import Snapshot as Snapshot  # public here too
from admission.inspect_read import snapshot as snapshot  # public here too
from admission.inspect_render import render as render  # public here too
from admission.inspect_target import SCAN_COUNT as SCAN_COUNT  # public here too
from admission.inspect_target import (
    NothingFound,
    Target,
    check_ca,
    choose_pools,
    resolve_target,
)
from admission.inspect_target import discover_pools as discover_pools  # public here too
from admission.keys import check_name

EXIT_REDIS = 1
"""Redis could not be read (unreachable, timed out, refused the credentials)."""
EXIT_CONFIG = 2
"""Bad flags or an invalid configuration file."""
EXIT_NOTHING = 3
"""Redis answered but holds no key of the pools asked for (or of any pool)."""

EPILOG = f"""\
Redis: --config FILE (REDIS_URL overrides its redis.url, as in the services), else --redis-url,
else REDIS_URL, else redis://127.0.0.1:6379/0. The address read (never its credentials) and the
pools are printed on stderr first.

With --watch, a refresh that fails (Redis timing out, restarting) is said on stderr and the
next one follows as usual; with --count, the status is that of the last refresh.

exit status: 0: shown (also when the reader of the output stops early, as `| head` does);
{EXIT_REDIS}: Redis unreachable or failing; {EXIT_CONFIG}: bad flags or configuration;
{EXIT_NOTHING}: Redis holds no kvgate key of those pools (or of any pool).
"""


class Unreadable(Exception):
    """Redis could not be read; the message names the address (without credentials)."""


class ReaderGone(Exception):
    """Whoever read stdout stopped (``| head``, a pager quit): nothing more to show. Without
    it, the write's BrokenPipeError (an OSError) was reported as Redis failing to be read."""


def write_stdout(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise ReaderGone from None


def silence_stdout() -> None:
    """Points stdout at /dev/null: what its buffer still holds would fail again when the
    interpreter flushes it at exit ("Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(OSError, ValueError):  # no descriptor (a captured stdout)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def seconds_argument(text: str) -> float:
    """`--watch`'s argparse type: a finite number of seconds above 0, else a usage error (exit
    2). float() takes "nan" and "inf", and asyncio.sleep of either never returns: one frame,
    then a hang that looks like a deployment gone quiet."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def pool_argument(text: str) -> str:
    """`--pool`'s argparse type: a valid pool name, else a usage error (exit 2)."""
    try:
        return check_name("pool", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvgate-inspect", description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", help="the services' TOML file (Redis settings, pools, tenants)")
    src.add_argument("--redis-url",
                     help="Redis URL (default: $REDIS_URL, else redis://127.0.0.1:6379/0)")
    parser.add_argument("--pool", action="append", default=[], type=pool_argument,
                        help="pool to show (repeatable; default: all configured or found)")
    parser.add_argument("--cluster", action="store_true",
                        help="--redis-url or REDIS_URL is a Redis Cluster (with --config, the "
                             "file's redis.cluster decides)")
    parser.add_argument("--ssl-ca-file",
                        help="CA bundle for a rediss:// URL, which it needs (with --config, "
                             "instead of the file's redis.ssl_ca_file)")
    parser.add_argument("--json", action="store_true", help="one JSON document per refresh")
    parser.add_argument("--watch", nargs="?", type=seconds_argument, const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until interrupted")
    parser.add_argument("--count", type=int, metavar="N", help="stop after N refreshes")
    args = parser.parse_args(argv)
    if args.count is not None and args.count < 1:
        parser.error("--count must be at least 1")
    return args


def _say(message: str) -> None:
    print(f"kvgate-inspect: {message}", file=sys.stderr, flush=True)


def _cannot_read(target: Target, exc: BaseException) -> str:
    # redis-py's messages name host and port, never the password in the URL.
    return f"cannot read Redis at {target.address}: {exc or type(exc).__name__}"


async def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    target = resolve_target(config=args.config, redis_url=args.redis_url,
                            cluster=args.cluster, ssl_ca_file=args.ssl_ca_file,
                            pools=args.pool, env=env)
    _say(target.announce())
    check_ca(target)
    client = connect(target.settings)
    try:
        return await _show(client, target, args)
    except REDIS_ERRORS as exc:
        raise Unreadable(_cannot_read(target, exc)) from None
    finally:
        await client.aclose()


async def _show(client: Any, target: Target, args: argparse.Namespace) -> int:
    pools = await choose_pools(client, target, _say)
    interval = 2.0 if args.watch is None else args.watch
    frames = args.count or (1 if args.watch is None else None)
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    refreshes = 0
    while True:
        failed = False
        try:
            snap = await snapshot(client, pools, target.tenants)
        except REDIS_ERRORS as exc:
            if args.watch is None:
                raise
            # --watch runs through an incident: a Redis that times out or restarts once must
            # not end it (its first reads, choose_pools', did answer). Said on stderr, and the
            # screen cleared, lest the last frame read as the current one.
            failed = True
            if clear:
                write_stdout("\x1b[H\x1b[2J")
            _say(f"refresh {refreshes + 1} failed: {_cannot_read(target, exc)}; "
                 f"trying again in {interval:g} s")
        else:
            out = snap.to_json() + "\n" if args.json else render(snap, target.address)
            write_stdout(("\x1b[H\x1b[2J" if clear else "") + out)
        refreshes += 1
        if frames is not None and refreshes >= frames:
            return EXIT_REDIS if failed else 0
        if not clear and not args.json and not failed:
            write_stdout("\n")
        await asyncio.sleep(interval)


def run_cli(command: Callable[[], Coroutine[Any, Any, int]], say: Callable[[str], None]) -> int:
    """Runs a command line tool's coroutine to its exit status, or to the status of what ended
    it, said through `say` (kvgate-inspect's and kvgate-prune's statuses mean the same)."""
    try:
        return asyncio.run(command())
    except ConfigError as exc:
        say(str(exc))
        return EXIT_CONFIG
    except NothingFound as exc:
        say(str(exc))
        return EXIT_NOTHING
    except Unreadable as exc:
        say(str(exc))
        return EXIT_REDIS
    except ReaderGone:
        silence_stdout()
        return 0
    except OSError as exc:  # Redis errors became Unreadable: this is the config file
        say(str(exc))
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: run(args, os.environ), _say)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m scheduler --config FILE``: one scheduler replica (run as many as you like).

The HTTP port is bound first: a port already in use, or an address the host does not have,
ends the process with one line on stderr and exit status 1 before the replica joins the leader
election. An invalid configuration ends it with one line and exit status 2; ``--check-config``
runs the same checks and exits (0 and ``configuration OK: ...`` on stdout, or 2 and the
error), without binding or connecting. SIGTERM and SIGINT stop the loops and resign leadership
before anything else, so a standby takes over at once; the HTTP server closes after that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys

from aiohttp import web

from admission.cli import (
    ENVIRONMENT_HELP,
    add_check_flag,
    add_service_flags,
    config_ok,
    listen,
    listen_error,
    program_name,
)
from admission.config import Config, ConfigError, check_mounted_files, in_file, load_config
from scheduler.app import SERVICE, create_app

log = logging.getLogger("kvgate.scheduler")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name("scheduler"),
        description="Run one kvgate scheduler replica: every replica stands for election, the "
                    "leader polls the vLLM nodes and releases queued work. Run as many as you "
                    "like; SIGTERM resigns leadership at once so that a standby takes over.",
        epilog=ENVIRONMENT_HELP)
    parser.add_argument("--config", required=True, help="TOML configuration file")
    parser.add_argument("--id", help="replica id (default: scheduler.id, else host-pid-random)")
    parser.add_argument("--host", help="listen address (default: scheduler.host)")
    add_service_flags(parser, "listen port (default: scheduler.port; 0 to 65535, 0: a free port)")
    add_check_flag(parser, "scheduler", "the CA files it names")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


async def serve(config: Config, me: str | None, sockets: list[socket.socket]) -> None:
    """Serve on `sockets` (bound by `listen`) until SIGTERM or SIGINT."""
    app = create_app(config, me=me)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # With port 0 the system picked one: name the port really bound.
        log.info("listening on %s:%d", config.scheduler.host, runner.addresses[0][1])
        await stop.wait()
    finally:
        # Resign first: the HTTP server's shutdown must not delay the handover.
        await app[SERVICE].stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        check_mounted_files(config)
    except ConfigError as exc:
        print(f"configuration error: {in_file(args.config, exc)}", file=sys.stderr)
        return 2
    if args.check_config:
        print(config_ok(args.config, config), flush=True)
        return 0
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, **overrides)
        )
    host, port = config.scheduler.host, config.scheduler.port
    try:
        sockets = listen(host, port)
    except OSError as exc:
        print(listen_error("scheduler", host, port, exc), file=sys.stderr)
        return 1
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    try:
        runner(serve(config, args.id, sockets))
    finally:
        for sock in sockets:  # closed with their sites, unless the app failed before them
            sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

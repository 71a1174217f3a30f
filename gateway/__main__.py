"""``python -m gateway --config FILE``: one gateway process.

Prints one line ``kvgate gateway <id> listening on http://HOST:PORT`` on stdout once it serves
(``--port 0`` picks a free port), logs to stderr, and stops on SIGTERM or SIGINT: it stops
accepting, lets requests in flight finish for up to ``--shutdown-timeout`` seconds, cancels
the rest, settles and exits, at most `gateway.shutdown.SETTLE_MARGIN_S` after the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from admission.config import ConfigError, load_config
from gateway.app import create_app
from gateway.shutdown import CANCEL_GRACE_S, SETTLE_MARGIN_S, stop_serving
from gateway.state import GATEWAY_ID, IN_FLIGHT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="TOML configuration file")
    p.add_argument("--host", help="override gateway.host")
    p.add_argument("--port", type=int, help="override gateway.port (0: a free port)")
    p.add_argument("--id", help="override gateway.id (unique per process)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, how long requests in flight may run before they are "
                        f"cancelled; the process exits at most {SETTLE_MARGIN_S:g} s later "
                        "(default: %(default)s)")
    return p


async def serve(app: web.Application, host: str, port: int, *, access_log: bool,
                shutdown_timeout: float) -> None:
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that hangs up cancels its queued request
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        # stop_serving waits for and cancels the requests itself; aiohttp's own wait is left
        # only for one that ignored its cancellation.
        shutdown_timeout=CANCEL_GRACE_S,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        # Everything built at start lives as long as the process: keep it out of the
        # collector's way, or each full collection walks it (tens of ms, in the tail).
        gc.collect()
        gc.freeze()
        print(f"kvgate gateway {app[GATEWAY_ID]} listening on http://{host}:{bound}",
              flush=True)
        await stop.wait()
    finally:
        await stop_serving(runner, app[IN_FLIGHT], shutdown_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(config, gateway_id=args.id)
    except ValueError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(serve(app, host, port, access_log=config.gateway.access_log,
                 shutdown_timeout=args.shutdown_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m scheduler --config FILE``: one scheduler replica (run as many as you like).

SIGTERM and SIGINT stop the loops and resign leadership before anything else, so a standby
takes over at once; the HTTP server closes after that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys

from aiohttp import web

from admission.config import Config, ConfigError, load_config
from scheduler.app import SERVICE, create_app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__)
    parser.add_argument("--config", required=True, help="TOML configuration file")
    parser.add_argument("--id", help="replica id (default: scheduler.id, else host-pid)")
    parser.add_argument("--host", help="listen address (default: scheduler.host)")
    parser.add_argument("--port", type=int,
                        help="listen port (default: scheduler.port; 0: a free port)")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def serve(config: Config, me: str | None) -> None:
    app = create_app(config, me=me)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.scheduler.host, config.scheduler.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # With port 0 the system picked one: name the port really bound.
    bound = runner.addresses[0][1] if runner.addresses else config.scheduler.port
    logging.getLogger("kvgate.scheduler").info("listening on %s:%d", config.scheduler.host, bound)
    try:
        await stop.wait()
    finally:
        # Resign first: the HTTP server's shutdown must not delay the handover.
        await app[SERVICE].stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, **overrides)
        )
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    runner(serve(config, args.id))
    return 0


if __name__ == "__main__":
    sys.exit(main())

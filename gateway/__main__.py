"""``python -m gateway --config FILE``: one gateway process.

Prints one line ``kvgate gateway <id> listening on http://HOST:PORT`` on stdout once it serves
(``--port 0`` picks a free port), logs to stderr, and stops on SIGTERM or SIGINT: it stops
accepting, lets requests in flight finish for up to ``--shutdown-timeout`` seconds, cancels
the rest, settles and exits, at most `gateway.shutdown.SETTLE_MARGIN_S` after the timeout.

The listening sockets are bound before the app starts (tokenizers, Redis): a port already in
use, or an address the host does not have, ends the process at once with one line on stderr
and exit status 1. An invalid configuration, a pool's tokenizer that cannot be loaded
included, ends it with one line and exit status 2.

``--check-config`` runs the same checks and exits (0 and ``configuration OK: ...`` on stdout,
or 2 and the error), without binding or connecting: a file can be checked before a rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import re
import signal
import socket
import sys
from collections.abc import Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from admission.cli import (
    GATEWAY_ENVIRONMENT_HELP,
    add_check_flag,
    add_service_flags,
    config_ok,
    listen,
    listen_error,
    non_negative_seconds,
    program_name,
)
from admission.config import (
    Config,
    ConfigError,
    check_mounted_files,
    in_file,
    load_config,
    startup_warnings,
)
from gateway.app import create_app
from gateway.estimator import load_tokenizer
from gateway.shutdown import CANCEL_GRACE_S, SETTLE_MARGIN_S, stop_serving
from gateway.state import CONFIG, GATEWAY, GATEWAY_ID, IN_FLIGHT

log = logging.getLogger("kvgate.gateway")

BACKLOG = 2048


class MalformedHeadFilter(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback whose message quotes the
    offending line: an `Authorization` header whose key ends in a stray CR (a key file with
    Windows line endings) or a control byte puts the key itself in the log. Such a record
    becomes one WARNING line naming the client and the kind of error, never the bytes."""

    _QUOTE = re.compile(r"[:'\"]")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        first_line = (exc.message or "").strip().split("\n", 1)[0]
        reason = self._QUOTE.split(first_line, 1)[0].strip() or type(exc).__name__
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args = "malformed HTTP request from %s: %s (HTTP %d)", (
            remote, reason, exc.code)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


HTTP_LOG = logging.getLogger("kvgate.gateway.http")
"""aiohttp's server logger for the gateway's connections (its "aiohttp.server" otherwise)."""
HTTP_LOG.addFilter(MalformedHeadFilter())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program_name("gateway"),
        description="Run one kvgate gateway: the OpenAI-compatible front of the vLLM pools "
                    "the configuration file describes.",
        epilog=GATEWAY_ENVIRONMENT_HELP)
    p.add_argument("--config", required=True, help="TOML configuration file")
    p.add_argument("--host", help="override gateway.host")
    add_service_flags(p, "override gateway.port (0 to 65535; 0: a free port)")
    p.add_argument("--id", help="override gateway.id (unique per process)")
    p.add_argument("--shutdown-timeout", type=non_negative_seconds, default=10.0,
                   metavar="SECONDS",
                   help="after SIGTERM, how long requests in flight may run before they are "
                        f"cancelled; the process exits at most {SETTLE_MARGIN_S:g} s later "
                        "(default: %(default)s)")
    add_check_flag(p, "gateway", "the CA files, the backends' API key variables, the --id "
                   "and the tokenizers it names")
    return p


def make_runner(app: web.Application, *, access_log: bool) -> web.AppRunner:
    """The runner of a gateway app made by `create_app` (its `CONFIG` is read), not set up.

    A connection without a complete request head is closed after `gateway.keepalive_timeout_ms`
    (the body's own deadline, `request_read_timeout_ms`, is the handler's). aiohttp has no
    timeout for a head: its keep-alive timer is the one bound, armed when a connection opens
    and when an answer ends, not moved by bytes that come in, and on firing it closes the
    connection if no complete head has arrived (idle or sent byte by byte alike)."""
    return web.AppRunner(
        app,
        handler_cancellation=True,  # a client that hangs up cancels its queued request
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        logger=HTTP_LOG,
        # stop_serving waits for and cancels the requests itself; aiohttp's own wait is left
        # only for one that ignored its cancellation.
        shutdown_timeout=CANCEL_GRACE_S,
        keepalive_timeout=app[CONFIG].gateway.keepalive_timeout_ms / 1000,
    )


async def serve(app: web.Application, host: str, sockets: list[socket.socket], *,
                access_log: bool, shutdown_timeout: float) -> None:
    runner = make_runner(app, access_log=access_log)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
        bound = runner.addresses[0][1]
        # Everything built at start lives as long as the process: keep it out of the
        # collector's way, or each full collection walks it (tens of ms, in the tail).
        gc.collect()
        gc.freeze()
        print(f"kvgate gateway {app[GATEWAY_ID]} listening on http://{host}:{bound}",
              flush=True)
        await stop.wait()
    finally:
        await stop_serving(runner, app[IN_FLIGHT], shutdown_timeout, lambda: _answer_queued(app))


def _answer_queued(app: web.Application) -> int:
    """The queued requests' 503 at shutdown (none when the gateway never finished starting)."""
    gateway = app.get(GATEWAY)
    return 0 if gateway is None else gateway.admitter.answer_queued()


def tokenizer_error(config: Config) -> str | None:
    """Why a pool's `tokenizer` cannot be loaded (naming the key), or None. Loaded here, not
    only when the app starts, so that a wrong path is one line and exit status 2 rather than
    a traceback; the app then finds it loaded (`load_tokenizer` keeps it per path)."""
    for i, pool in enumerate(config.pools.values()):
        if pool.tokenizer is None:
            continue
        try:
            load_tokenizer(pool.tokenizer)
        except OSError as exc:  # missing, a directory without tokenizer.json, unreadable
            return (f"pools[{i}].tokenizer: cannot read {exc.filename or pool.tokenizer!r} "
                    f"({exc.strerror or exc})")
        except Exception as exc:  # the tokenizers library raises bare Exception on bad JSON
            return (f"pools[{i}].tokenizer: {pool.tokenizer!r} is not a tokenizer.json "
                    f"(plain or gzip) or a directory holding one: {exc}")
    return None


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _checked(path: str, config: Config) -> int:
    """`--check-config`'s end, once the checks before the port's binding passed: the
    tokenizers (loaded, as at start) and the start-up warnings, which a check shows too."""
    problem = tokenizer_error(config)
    if problem is not None:
        print(f"configuration error: {path}: {problem}", file=sys.stderr)
        return 2
    for warning in startup_warnings(config):
        log.warning("%s", warning)
    print(config_ok(path, config), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # In a container this process is PID 1, which the kernel spares from SIGTERM's default
    # action: until serve() installs its handler (after the tokenizers load, which can take a
    # minute), a pod deleted while starting would wait out its whole grace period, then be
    # killed. Nothing is served or queued yet, so exiting at once loses nothing.
    signal.signal(signal.SIGTERM, _exit_on_term)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        check_mounted_files(config)
        app = create_app(config, gateway_id=args.id)
    except ConfigError as exc:  # a CA file or an API key's variable the file names
        print(f"configuration error: {in_file(args.config, exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the --id flag's
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        return _checked(args.config, config)
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    try:
        sockets = listen(host, port)
    except OSError as exc:
        print(listen_error("gateway", host, port, exc), file=sys.stderr)
        return 1
    problem = tokenizer_error(config)
    if problem is not None:
        for sock in sockets:
            sock.close()
        print(f"configuration error: {args.config}: {problem}", file=sys.stderr)
        return 2
    for warning in startup_warnings(config):
        log.warning("%s", warning)
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(app, host, sockets, access_log=config.gateway.access_log,
                     shutdown_timeout=args.shutdown_timeout))
    finally:
        for sock in sockets:  # closed with their sites, unless the app failed before them
            sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

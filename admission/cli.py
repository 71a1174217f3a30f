"""What the services' command lines share: the command's name as it was run, the flags that
override the configuration file (`--port`, `--log-level`: `add_service_flags`), what the
environment overrides, and the one line a service prints when it cannot bind its port."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from admission.configfields import PORT_MAX

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""`--log-level`'s choices, taken in any case (the flag's argparse type is `str.upper`)."""

ENVIRONMENT_HELP = ("environment: REDIS_URL, when set and not empty, overrides redis.url "
                    "of the configuration file")


def port_argument(text: str) -> int:
    """`--port`'s argparse type: a port within the bounds of the settings it overrides, else a
    usage error (exit 2), rather than a port that wraps modulo 65536 or a resolver error when
    the service binds it."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to {PORT_MAX} "
                                         f"(0: a free port), got {text!r}")
    return value


def add_service_flags(parser: argparse.ArgumentParser, port_help: str) -> None:
    """`--port` (`port_help` says which setting it overrides) and `--log-level`."""
    parser.add_argument("--port", type=port_argument, help=port_help)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                        metavar="LEVEL", help="least severity logged to stderr: "
                        f"{', '.join(LOG_LEVELS)}, in any case (default: %(default)s)")


def listen_error(service: str, host: str, port: int, exc: OSError) -> str:
    """The one line a service prints when it cannot bind its port: why, and what to do."""
    if exc.errno == errno.EADDRINUSE:
        reason = (f"address already in use (by another {service}, or another program): "
                  f"choose another port with --port or {service}.port")
    else:
        reason = exc.strerror or str(exc)
    return f"cannot listen on {host}:{port}: {reason}"


def program_name(module: str) -> str:
    """The command as it was run, for `--help` and usage errors: the console script's name
    (``kvgate-gateway``), or ``python -m <module>`` when run as a module."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    if not name or name == "__main__.py" or name.startswith("-"):
        return f"python -m {module}"
    return name

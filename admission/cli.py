"""What the services' command lines share: the command's name as it was run, the flags that
override the configuration file (`--port`, `--log-level`: `add_service_flags`), the offline
check of the configuration (`--check-config`: `add_check_flag`, `config_ok`), what the
environment overrides, and their port: bound before anything else starts (`listen`), or the
one line a service prints when it cannot be (`listen_error`)."""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys

from admission.configfields import PORT_MAX
from admission.configschema import Config

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""`--log-level`'s choices, taken in any case (the flag's argparse type is `str.upper`)."""

ENVIRONMENT_HELP = ("environment: REDIS_URL, when set and not empty, overrides redis.url "
                    "of the configuration file")
GATEWAY_ENVIRONMENT_HELP = (ENVIRONMENT_HELP + "; KVGATE_ADMIN_TOKEN_SHA256, when set and not "
                            "empty, overrides gateway.admin_token_sha256")


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


def add_check_flag(parser: argparse.ArgumentParser, service: str, what: str) -> None:
    """`--check-config`: validate the configuration as the service would at start, then exit;
    `what` lists what the service checks besides the file and the files it names."""
    parser.add_argument(
        "--check-config", action="store_true",
        help=f"load and validate the configuration as the {service} does at start ({what}), "
             "connecting to nothing and binding nothing; print 'configuration OK: FILE (N "
             "pools, M tenants)' and exit 0, or the error and exit 2")


def config_ok(path: str, config: Config) -> str:
    """The line `--check-config` prints for a valid configuration."""
    pools, tenants = len(config.pools), len(config.tenants)
    return (f"configuration OK: {path} ({pools} pool{'' if pools == 1 else 's'}, "
            f"{tenants} tenant{'' if tenants == 1 else 's'})")


def non_negative_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more, else a usage error (exit 2).
    float() takes "-5", "nan" and "inf": a deadline already past, or one that never comes."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text!r}")
    return value


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


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `port` on every address `host` resolves to, as the event loop's own
    `create_server` would bind them (SO_REUSEADDR; IPv6 sockets IPv6 only, so that they do not
    collide with the IPv4 ones; an address family the host cannot open skipped); OSError if
    one cannot be bound, after closing the others."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # e.g. IPv6 disabled in the kernel while the resolver offers it
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    if not bound:
        raise OSError(f"no address of {host!r} can be opened")
    return bound

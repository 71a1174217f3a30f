"""How a setting of the TOML configuration is declared: one dataclass field, its one default.

A settings dataclass (admission.configschema, admission.controlconfig, admission.fairconfig,
admission.quotaconfig) declares each key as a field whose annotation is the key's type and
whose default is the key's default; `at_least`, `between`, `optional_between`, `tcp_port` and
`one_of` add the bounds a value must keep, and `optional_text` refuses an optional string's
`""`. The loader (admission.config) reads every field from the file by those declarations
alone, so a default or a bound is written once, next to the setting it belongs to. Every
integer setting also has a ceiling its declaration need not repeat (`ceiling_error`), and the
checks of values that several settings share (URLs, addresses, hashes) are here too.

A class may also declare

- `check(self, key)`: the checks that span several of its settings; `key(name)` is the full
  name of a setting as errors show it (`pools[0].zones.red`), and `check` raises ConfigError;
- `REPLACED`: keys that no longer exist, each mapped to the message that names what replaced
  it (`{name}` in the message is the full name of the setting `name`). Such a key in a file is
  a start-up error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

from redis.connection import FALSE_STRINGS

KeyName = Callable[[str], str]
"""The full name of a setting of the table being read, e.g. "yellow" -> "pools[0].zones.yellow"."""

BOUNDS = "kvgate.bounds"
"""The field metadata key holding a setting's `Bounds`."""


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""

    def __init__(self, message: str, *, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable
        """The environment variable whose value is at fault (`REDIS_URL`), or None when the
        file is: an error about a variable does not name the file (admission.config.in_file),
        which holds nothing wrong."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a value must satisfy besides its type."""

    lo: float | None = None
    """The least value (an integer setting's minimum, a number setting's lower end)."""
    hi: float | None = None
    """The upper end (None: only `lo` bounds the value)."""
    choices: tuple[str, ...] = ()
    """A string must be one of these (empty: any string)."""
    why: str = ""
    """Why the least value is what it is, added to the message of a value below it (the
    reader of "must be >= 4" otherwise wonders what a smaller one would break)."""

    def error(self, value: Any) -> str | None:
        """Why `value` breaks the bounds (the text after the key), or None."""
        if self.choices:
            if value in self.choices:
                return None
            return "must be " + " or ".join(repr(c) for c in self.choices)
        if self.hi is None:
            if self.lo is not None and value < self.lo:
                return f"must be >= {self.lo}, got {value}" + (f": {self.why}" if self.why else "")
            return None
        if self.lo is not None and not self.lo <= value <= self.hi:
            return f"must be between {self.lo} and {self.hi}, got {value}"
        return None


def bounds_of(f: dataclasses.Field[Any]) -> Bounds | None:
    found = f.metadata.get(BOUNDS)
    return found if isinstance(found, Bounds) else None


def at_least(minimum: int, default: int, why: str = "") -> int:
    """An integer setting of at least `minimum`; `why`: what a smaller value would break,
    for the message that refuses one."""
    return field(default=default, metadata={BOUNDS: Bounds(lo=minimum, why=why)})


def between(lo: float, hi: float, default: float) -> float:
    """A number setting in [lo, hi] (both finite, so NaN and infinities are refused)."""
    assert math.isfinite(lo) and math.isfinite(hi)
    return field(default=default, metadata={BOUNDS: Bounds(lo=float(lo), hi=float(hi))})


PORT_MAX = 65535
"""The highest TCP port: a larger number would wrap modulo 65536 when bound."""


def tcp_port(default: int) -> int:
    """A TCP port setting: 0..`PORT_MAX` (0: the system picks a free port)."""
    return field(default=default, metadata={BOUNDS: Bounds(lo=0, hi=PORT_MAX)})


def optional_at_least(minimum: int) -> int | None:
    """An integer setting of at least `minimum`, unset (None) by default."""
    return field(default=None, metadata={BOUNDS: Bounds(lo=minimum)})


def optional_between(lo: float, hi: float) -> float | None:
    """A number setting in [lo, hi], unset (None) by default."""
    return field(default=None, metadata={BOUNDS: Bounds(lo=float(lo), hi=float(hi))})


def one_of(default: str, *others: str) -> str:
    """A string setting that must be `default` or one of `others`."""
    return field(default=default, metadata={BOUNDS: Bounds(choices=(default, *others))})


UNSET = "kvgate.unset"
"""The field metadata key holding what an optional string setting left out means."""


def optional_text(unset: str) -> str | None:
    """A string setting, unset (None) by default, whose `""` is refused: `unset` says what
    leaving it out means, for the message. Without the refusal an empty path reads the current
    directory (a tokenizer) or means the default silently (a CA file: the system's CAs), which
    a template that rendered an unset variable as `""` would otherwise get."""
    return field(default=None, metadata={UNSET: unset})


def required_at_least(minimum: int) -> Any:
    """An integer setting of at least `minimum` with no default of its own (the caller
    supplies the defaults, as `admission.configschema.DEFAULT_TIERS` does per tier)."""
    return field(metadata={BOUNDS: Bounds(lo=minimum)})


MAX_INTEGER = 2**53 - 1
"""The largest integer setting: the Lua scripts hold numbers as doubles, exact up to here."""
MAX_DURATION = {"_ms": 31_536_000_000, "_s": 31_536_000}
"""The longest duration setting, one year, by the unit its name ends with: the scripts turn
durations into microseconds and add them to the clock, and far above a year the sum leaves
Redis' integer range (a lease of 1e20 ms is refused by every call that sets it)."""


def ceiling_error(name: str, value: int) -> str | None:
    """Why integer setting `name` is too large (the text after the key), or None. A rate
    (`*_per_s`) is not a duration: only the integer bound applies to it."""
    for suffix, most in MAX_DURATION.items():
        if name.endswith(suffix) and not name.endswith("_per_s") and value > most:
            return f"must be at most {most} (one year), got {value}"
    if value > MAX_INTEGER:
        return f"must be at most {MAX_INTEGER} (2^53 - 1), got {value}"
    return None


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" ("[v6::addr]:port" for IPv6); ValueError saying what is
    wrong if malformed. Checked when the file is loaded: the Sentinel client would otherwise
    take `redis://h:26379` as host `redis` and fail each connection, at run time."""
    parts = _address_parts(address)
    if isinstance(parts, str):
        raise ValueError(f"{address!r} is not host:port: {parts}")
    return parts


def _address_parts(address: str) -> tuple[str, int] | str:
    """("host", port) of `address`, or what is wrong with it."""
    if "://" in address:
        return ("leave out the scheme (whether the Sentinels are reached with TLS is "
                "redis.url's scheme)")
    if any(c.isspace() for c in address):
        return "it contains a space"
    if address.startswith("["):
        host, close, rest = address[1:].partition("]")
        if not close or "[" in host or "]" in rest:
            return "unbalanced brackets (an IPv6 address is written [v6addr]:port)"
        if rest and not rest.startswith(":"):
            return "the port must follow the bracketed address ([v6addr]:port)"
        port = rest[1:]
    else:
        if "[" in address or "]" in address:
            return "unbalanced brackets (an IPv6 address is written [v6addr]:port)"
        host, sep, port = address.rpartition(":")
        if not sep:
            return "no port"
        if ":" in host:
            return "an IPv6 address goes in brackets ([v6addr]:port)"
    if not port:
        return "no port"
    if not host:
        return "no host"
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) <= PORT_MAX:
        return f"port {port!r} is not a number from 1 to {PORT_MAX}"
    return host, int(port)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_sha256(value: str) -> bool:
    """A lowercase hex SHA-256, as tenants' keys and the admin token are given."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def shown_url(url: str) -> str:
    """`url` as a message may quote it: whatever precedes its last '@' after the scheme (user
    name and password, however malformed: an unencoded '/' in the password moves urlsplit's
    idea of where the host starts) is replaced by `***`. A URL refused at start is printed to
    stderr, i.e. the log: `REDIS_URL=redis://:${PASSWORD}@${HOST}:6379/0` with HOST unset named
    its password there. So is the value of a `password` or `username` query parameter,
    which redis-py also reads."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        url = f"{scheme}://***@{rest.rpartition('@')[2]}"
    return _SECRET_QUERY.sub(r"\1***", url)


_SECRET_QUERY = re.compile(r"([?&](?:password|username)=)[^&#]*", re.IGNORECASE)


def _split(url: str) -> SplitResult | str:
    """`url`'s parts, or why it has none: urlsplit refuses an unbalanced or misplaced '['
    (an IPv6 address typed without its closing bracket) with a bare ValueError, which the
    services' start would show as a traceback instead of a line naming the key."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        return f"{shown_url(url)!r} is not a valid URL ({exc})"


TLS_QUERY = {
    "ssl_cert_reqs": "none, optional or required, in lower case (default: required)",
    "ssl_check_hostname": "true or false (default: true; false with ssl_cert_reqs=none)",
    "ssl_ca_certs": "the CA file (redis.ssl_ca_file too; the URL's wins)",
    "ssl_certfile": "the client certificate, for mutual TLS",
    "ssl_keyfile": "the client certificate's key, if not in ssl_certfile",
}
"""The TLS settings a rediss:// URL may carry, which every connection honours (the gateways'
own multiplexed connection as much as the client library's). Any other `ssl_*` parameter is
refused: the client library would apply it to some connections and not to the others."""


URL_QUERY = ("db", "username", "password")
"""The other query parameters a Redis URL may carry: the database (a unix:// socket's only way
to name one) and the credentials, which redis-py and the gateways' multiplexed connection both
read from the URL. Anything else is refused: redis-py hands every query parameter to its
connections as a keyword, so a misspelt one (`sockettimeout`) fails every connection with a
TypeError, and a real one (`socket_timeout`) would override the `[redis]` setting for its
connections but not for the multiplexed one, which reads `[redis]` alone."""


def url_query(url: str) -> dict[str, str]:
    """A URL's query parameters, the first of each repeated one, as redis-py's parse_url reads
    them (so a check and the connection see the same value)."""
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


BOOLEAN_WORDS = frozenset({*FALSE_STRINGS, "1", "T", "TRUE", "Y", "YES", "ON"})
"""The words a URL's boolean may be, in upper case: redis-py's false ones and their true
counterparts."""

MAX_DATABASE = 2**31 - 1
"""The highest database number Redis can have (its `databases` setting is an int)."""


def _tls_query_error(url: str, query: dict[str, str]) -> str | None:
    for name in query:
        if not name.startswith("ssl_"):
            continue
        if name not in TLS_QUERY:
            return (f"its query parameter {name} is not supported; a rediss:// URL may carry "
                    + ", ".join(TLS_QUERY))
        if not url.startswith("rediss://"):
            return f"its query parameter {name} needs a rediss:// URL (TLS)"
    reqs = query.get("ssl_cert_reqs")
    if reqs is not None and reqs not in ("none", "optional", "required"):  # as redis-py reads
        return f"ssl_cert_reqs {reqs!r} must be {TLS_QUERY['ssl_cert_reqs']}"
    check = query.get("ssl_check_hostname")
    if check is not None and check.upper() not in BOOLEAN_WORDS:
        # redis-py reads any word but its false ones as true: `flase` would check the name.
        return (f"ssl_check_hostname {check!r} must be true or false (or 1, 0, yes, no, on, "
                "off, in any case)")
    if "ssl_keyfile" in query and "ssl_certfile" not in query:
        return "ssl_keyfile needs ssl_certfile (the certificate the key belongs to)"
    return None


def _query_error(query: dict[str, str]) -> str | None:
    for name in query:
        if name not in URL_QUERY and name not in TLS_QUERY:
            return (f"its query parameter {name} is not supported: a Redis URL may carry "
                    f"{', '.join(URL_QUERY)} and, on rediss://, {', '.join(TLS_QUERY)}; "
                    "timeouts and the connection pool are [redis] settings "
                    "(socket_timeout_ms, connect_timeout_ms, max_connections, pool_timeout_ms)")
    return None


def _port_error(url: str) -> str | None:
    try:
        port = urlsplit(url).port
    except ValueError:
        return "has a port that is not a number from 1 to 65535"
    return "has port 0, which nothing listens on" if port == 0 else None


def backend_url_error(url: str) -> str | None:
    """Why `url` cannot be a backend's address (the text after the key), or None.

    The services append the API paths to it (`/v1/chat/completions`, `/metrics`), so it is a
    server's root: a path is allowed only as a reverse proxy's prefix (`/vllm/node-1`), never
    holding a `v1` segment or ending in `metrics`, and a query or fragment would end up before
    the appended path."""
    if not url.startswith(("http://", "https://")):
        return "must be an http:// or https:// URL"
    parts = _split(url)
    if isinstance(parts, str):
        return parts
    if any(c.isspace() for c in url):
        return f"{shown_url(url)!r} contains a space"
    if not parts.hostname:
        return f"{shown_url(url)!r} names no host (expected http://HOST:PORT)"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return (f"{shown_url(url)!r}: a query or fragment is not allowed (expected "
                "http://HOST:PORT)")
    endpoint = _endpoint_path(parts.path)
    if endpoint:
        return (f"{shown_url(url)!r}: leave out the {endpoint}: the URL is the server's base, "
                "to which the gateway appends /v1/chat/completions and the scheduler /metrics")
    return _port_error(url)


API_PATHS = ("chat", "completions", "models", "embeddings", "responses")
"""What follows `v1` in the OpenAI API's paths: a `v1` segment before one of these (or last)
starts an endpoint, while a proxy's prefix may hold `v1` elsewhere (the Kubernetes API
server's service proxy: `/api/v1/namespaces/<ns>/services/<svc>/proxy`)."""


def _endpoint_path(path: str) -> str:
    """The part of a backend URL's path that is an API's, not a reverse proxy's prefix: from a
    last `v1` segment or one followed by an OpenAI API path (`API_PATHS`), or a last segment
    `metrics` ("" if none). Accepted, a whole endpoint's URL would be appended to: every
    request would go to `.../v1/chat/completions/v1/...`."""
    segments = path.rstrip("/").split("/")
    for i, segment in enumerate(segments):
        if segment == "v1" and (i == len(segments) - 1 or segments[i + 1] in API_PATHS):
            return "/".join(["", *segments[i:]])
    return "/metrics" if segments[-1] == "metrics" else ""


def redis_url_error(url: str, *, needs_host: bool = True) -> str | None:
    """Why `url` cannot be a Redis URL (the text after the key), or None. `needs_host`:
    False when the host is found elsewhere (Sentinel), so the URL may leave it out.

    What the Redis client would otherwise do silently is refused: a database that is not a
    number (read as database 0) or above `MAX_DATABASE`, a URL without a host (read as
    localhost), a space in the host, a unix:// URL naming a host (ignored), a query parameter
    other than `URL_QUERY` and `TLS_QUERY` (handed to every connection as is), a boolean that
    is not one of `BOOLEAN_WORDS` (read as true). The message never shows the URL's password:
    the services print it, and their output ends up in logs."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    parts = _split(url)
    if isinstance(parts, str):
        return parts
    query = url_query(url)
    problem = _tls_query_error(url, query)
    if problem is not None:
        return problem
    shown = repr(shown_url(url))
    address = parts.netloc.rpartition("@")[2]
    if url.startswith("unix://"):
        if address:
            return (f"{shown} names host {address!r}, which a unix:// URL would ignore "
                    "(expected unix:///path/to/redis.sock)")
        if not parts.path:
            return f"{shown} names no socket path (expected unix:///path/to/redis.sock)"
        db = query.get("db", "0")
    else:
        if "@" in url.partition("://")[2] and "@" not in parts.netloc:
            # A '/', '?' or '#' in the password ends the address before the '@': the rest
            # would be read as host, path or database, and shown in the messages below.
            return ("its user name or password holds a '/', '?' or '#', which ends the address "
                    "there: percent-encode those characters, or use a password of URL-safe "
                    "characters (A-Z a-z 0-9 . _ ~ -)")
        if any(c.isspace() for c in address):
            return f"{shown}: its host contains a space"
        if needs_host and not parts.hostname:
            return f"{shown} names no host (expected redis://HOST:PORT/DB)"
        problem = _port_error(url)
        if problem is not None:
            return problem
        db = query.get("db", parts.path.strip("/") or "0")
    # After the host's checks: a URL that names no host says so first, whatever its query.
    problem = _query_error(query)
    if problem is not None:
        return problem
    if not (db.isascii() and db.isdigit()):
        return (f"database {db!r} is not a database number (the path is the database: "
                "redis://HOST:PORT/0)")
    if len(db.lstrip("0")) > len(str(MAX_DATABASE)) or int(db) > MAX_DATABASE:
        return (f"database {db} is out of range: Redis numbers its databases from 0 to "
                f"{MAX_DATABASE}")
    return None

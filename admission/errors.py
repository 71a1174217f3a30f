"""Errors of the admission core, and which errors of Redis a retry can get past.

Every loop that retries Redis calls (settling a task, and any other) asks `is_transient`
whether to retry at all and a `RetryPolicy` how long to wait and when to stop: a permanent
error is never retried, a transient one only within the policy's bounds. A gateway's admission
asks it too: only a transient failure (an outage) may fail open or get a retryable 503; a
permanent one is a 500 that says not to retry.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass

import redis.exceptions as rexc


class AdmissionError(Exception):
    """Base of everything this package raises on purpose."""


class ScriptReplyError(AdmissionError):
    """A script answered in a shape this version does not understand (mixed deployments)."""


class FencedError(AdmissionError):
    """A scheduler wrote with an epoch older than the pool's: it is no longer the leader."""

    def __init__(self, pool: str, epoch: int, current: int) -> None:
        super().__init__(f"pool {pool}: epoch {epoch} is fenced out by epoch {current}")
        self.pool = pool
        self.epoch = epoch
        self.current = current


# --- which Redis errors can pass -------------------------------------------------------------

TRANSIENT_REPLY_CODES = frozenset({
    "BUSY",         # a script runs past lua-time-limit; it ends or is killed
    "LOADING",      # the server is loading its dataset after a restart
    "READONLY",     # a failover made this server a replica; the next connection finds the primary
    "MASTERDOWN",   # a replica lost its primary (replica-serve-stale-data no)
    "TRYAGAIN",     # Cluster: the keys' slot is being migrated
    "CLUSTERDOWN",  # Cluster: a slot is not served until the cluster heals
    "MOVED",        # Cluster: a redirect the client did not follow in time
    "ASK",
    "NOREPLICAS",   # min-replicas-to-write not met while replicas reconnect
    "OOM",          # maxmemory with noeviction: passes once memory is freed (tasks end, expire)
    "MISCONF",      # a failed RDB or AOF write refuses writes until a write to disk succeeds
    "NOSCRIPT",     # the script cache was flushed again between load and retry
})
"""Error codes (the first word of a Redis error reply) a retry can get past. Every other
reply is permanent: NOPERM (ACL), WRONGTYPE, NOAUTH, WRONGPASS, EXECABORT, and ERR, which
covers a script that fails at run time."""


_CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (rexc.AuthenticationError, getattr(rexc, "AuthorizationError", None),
                    ssl.SSLCertVerificationError)
    if isinstance(cls, type))
"""Connection errors that a retry cannot get past (older redis-py has no AuthorizationError).
Found anywhere in the chain of causes: redis-py and the gateway's multiplexed connection raise
a failed TLS handshake as a ConnectionError *from* the SSLCertVerificationError, and redis-py's
cluster client raises rejected credentials as a RedisClusterException from them."""

REDIS_ERRORS: tuple[type[BaseException], ...] = (
    rexc.RedisError, rexc.RedisClusterException, OSError)
"""Everything a Redis call raises because of Redis rather than of its caller: what a service
catches around one, counts and logs as a Redis failure (and `is_transient` then sorts).
`RedisClusterException` is no RedisError: redis-py's cluster client raises a cluster that none
of its nodes answer (RedisClusterUnreachableError), a slot no node serves (SlotNotCoveredError)
and a seed that is not in cluster mode through it. Caught as RedisError alone, a cluster outage
crashed the scheduler's loops and answered clients 500 (OSError covers builtins' TimeoutError,
which is asyncio's)."""

_MAX_CAUSES = 8
"""How far `is_transient` follows the chain of causes (a chain is short; a cycle is not
followed forever)."""


def _cause_of(exc: BaseException) -> BaseException | None:
    """What `exc` was raised from, or while handling (older redis-py wraps a socket's error
    without `from`), as a traceback shows it."""
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc`, then its causes (`_cause_of`), at most `_MAX_CAUSES` in all."""
    chain = [exc]
    while len(chain) < _MAX_CAUSES:
        cause = _cause_of(chain[-1])
        if cause is None or any(cause is seen for seen in chain):
            break
        chain.append(cause)
    return chain


def reply_code(exc: BaseException) -> str | None:
    """The Redis error code of an error reply: redis-py keeps it in `status_code` (and strips
    it from the message); a reply raised as is (gateway/redismux.py) starts with it."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    head = str(exc).split(" ", 1)[0]
    return head if head.isalpha() and head.isupper() else None


_SCRIPT_ERROR = "Error running script"
_CODE_WORD = re.compile(r"-?\b([A-Z]{2,})\b")


def _script_wrapped_code(message: str) -> str | None:
    """The reply code of a command a script ran, where Redis before 7.0 wrapped it in its own
    `ERR Error running script (call to f_...): @user_script:N: -OOM command not allowed ...`:
    the condition is the command's (OOM, READONLY, MISCONF pass by themselves), not the
    script's. None when the message is no such wrapper or names no transient code."""
    at = message.find(_SCRIPT_ERROR)
    if at < 0:
        return None
    for word in _CODE_WORD.findall(message[at + len(_SCRIPT_ERROR):]):
        if word in TRANSIENT_REPLY_CODES:
            return str(word)
    return None


def describe(exc: BaseException) -> str:
    """What a log line may say about a Redis error: its class and reply code, never its
    message (which can quote keys and arguments). A credential error wrapped in another
    (a certificate that does not verify reaches callers as a ConnectionError raised from it)
    is named too, a certificate's with OpenSSL's reason ("self-signed certificate", "Hostname
    mismatch, certificate is not valid for 'redis'"): the line an operator reads must say what
    to fix, not only that a connection failed."""
    code = reply_code(exc)
    said = type(exc).__name__ if code is None else f"{type(exc).__name__} {code}"
    inner = next((e for e in _causes(exc)[1:] if isinstance(e, _CREDENTIAL_ERRORS)), None)
    if inner is None or type(inner) is type(exc):
        return said
    reason = getattr(inner, "verify_message", None)
    if isinstance(reason, str) and reason:
        return f"{said} from {type(inner).__name__} ({reason[:120]})"
    return f"{said} from {type(inner).__name__}"


def is_transient(exc: BaseException) -> bool:
    """True when the same call may succeed if retried later: the connection failed or timed
    out, or the server answered with a condition that passes by itself (`TRANSIENT_REPLY_CODES`:
    busy, loading, failover, cluster reconfiguration). False for everything that fails the same
    way every time until an operator acts: bad credentials or ACL, a key of the wrong type, a
    script error, a reply this version does not understand, a bug."""
    if any(isinstance(e, _CREDENTIAL_ERRORS) for e in _causes(exc)):
        # A certificate that does not verify, or credentials Redis refuses, however wrapped:
        # only an operator changes that (a retry would only hide it behind a deadline).
        return False
    if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, rexc.InvalidResponse,
                        rexc.ClusterError, rexc.SlotNotCoveredError, OSError)):
        # Includes BusyLoadingError, MaxConnectionsError, builtins TimeoutError, refused
        # connections; InvalidResponse (a garbled stream) drops the connection.
        return True
    if isinstance(exc, (rexc.ReadOnlyError, rexc.TryAgainError, rexc.AskError,
                        rexc.OutOfMemoryError, rexc.NoScriptError)):
        return True  # MovedError is an AskError
    if isinstance(exc, rexc.ResponseError):
        return (reply_code(exc) in TRANSIENT_REPLY_CODES
                or _script_wrapped_code(str(exc)) in TRANSIENT_REPLY_CODES)
    if isinstance(exc, rexc.RedisClusterException):
        # No RedisError (`REDIS_ERRORS`): redis-py's cluster client raises a cluster none of
        # whose nodes answers as RedisClusterUnreachableError (newer redis-py; older: a plain
        # RedisClusterException), each from the connection error or timeout that ended the
        # attempt. That passes when the cluster is back; one without such a cause (a key
        # spanning slots, a seed not in cluster mode) fails the same way every time.
        unreachable = getattr(rexc, "RedisClusterUnreachableError", None)
        for link in _causes(exc):
            if isinstance(link, rexc.SlotNotCoveredError) or (
                    isinstance(unreachable, type) and isinstance(link, unreachable)):
                return True
            if not isinstance(link, rexc.RedisClusterException):
                return is_transient(link)  # no cluster exception: no recursion past this one
    return False


# --- retrying them ---------------------------------------------------------------------------

MAX_BACKOFF_EXPONENT = 62
"""Doubling stops here (the cap is reached long before): keeps 2 ** n a float."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a loop retries transient errors: waits doubling from `initial_delay_s` up to
    `max_delay_s`, each shortened by up to `jitter` (a fraction) so that replicas that failed
    together (one outage) do not retry in step; at most `max_attempts` calls, and none started
    later than `deadline_s` after the first."""

    initial_delay_s: float
    max_delay_s: float
    max_attempts: int
    deadline_s: float
    jitter: float = 0.25

    def delay(self, failures: int, rand: float = 0.0) -> float:
        """Seconds to wait after the `failures`-th failed call (1 for the first); `rand` in
        [0, 1) picks the jitter (0: none)."""
        exponent = min(max(failures - 1, 0), MAX_BACKOFF_EXPONENT)
        base = min(self.max_delay_s, self.initial_delay_s * 2.0 ** exponent)
        return base * (1.0 - self.jitter * rand)

    def next_delay(self, failures: int, elapsed_s: float, rand: float = 0.0) -> float | None:
        """The wait before the next call after `failures` failed calls and `elapsed_s` since
        the first began, or None to give up: `max_attempts` calls made, or the next would
        start past `deadline_s`."""
        if failures >= self.max_attempts:
            return None
        wait = self.delay(failures, rand)
        if elapsed_s + wait > self.deadline_s:
            return None
        return wait

"""Private redis-server processes on free loopback ports.

Used by the tests, the benchmarks and the local demo so that none of them depends on a Redis
somebody started by hand (or on the one this machine happens to run on 6379). It lives in the lab,
not in the shipped `admission` package: a deployed gateway or scheduler connects to the Redis it
is configured with and never starts one.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 10.0


class RedisBinaryMissing(RuntimeError):
    pass


# Test processes running side by side (pytest-xdist's workers, gw0, gw1, ...) each take ports
# from blocks of their own, below Linux's ephemeral range (32768 and up, what port 0 and
# outgoing connections get): a port one process found free and closed cannot become another's
# before its server binds it, or the first would wait for, and talk to, the other's server.
# Servers: 24000-29999; Redis Cluster nodes: 10000-12999, their bus ports 10000 above.
PORT_BLOCK_BASE, PORT_BLOCK, PORT_BLOCKS = 24_000, 1_000, 6
CLUSTER_BLOCK_BASE, CLUSTER_BLOCK = 10_000, 500
_block_next: dict[int, int] = {}


def _worker_block() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:]) % PORT_BLOCKS
    return None


def free_port() -> int:
    """A loopback TCP port nothing listens on now, for a server about to start on it."""
    block = _worker_block()
    if block is not None:
        base = PORT_BLOCK_BASE + block * PORT_BLOCK
        # In turn through the block (from a random start): two picks before either server
        # binds must not be the same port.
        at = _block_next.get(block, random.randrange(PORT_BLOCK))
        for step in range(PORT_BLOCK):
            candidate = base + (at + step) % PORT_BLOCK
            if _bindable(candidate):
                _block_next[block] = (at + step + 1) % PORT_BLOCK
                return candidate
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis caps it at 55535."""
    rng = random.Random()
    block = _worker_block()
    lo, hi = 20_000, 45_000
    if block is not None:
        lo = CLUSTER_BLOCK_BASE + block * CLUSTER_BLOCK
        hi = lo + CLUSTER_BLOCK
    for _ in range(1000):
        port = rng.randrange(lo, hi)
        if _bindable(port) and _bindable(port + 10_000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RedisBinaryMissing(
            "redis-server is not installed; `make redis-server` installs the Debian package"
        )
    return found


@dataclass
class LocalRedis:
    """One redis-server child process; `url` is what clients connect to."""

    port: int
    workdir: Path
    process: subprocess.Popen[bytes]
    password: str | None = None
    tls: bool = False
    extra: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=5)

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait_listening(port: int, process: subprocess.Popen[bytes], logfile: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = logfile.read_text(errors="replace") if logfile.exists() else ""
            raise RuntimeError(f"redis-server exited with {process.returncode}: {log[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.01)
    raise TimeoutError(f"redis-server did not listen on {port} within {START_TIMEOUT_S}s")


def start_redis(
    *,
    port: int | None = None,
    password: str | None = None,
    tls_dir: Path | None = None,
    args: Sequence[str] = (),
    workdir: Path | None = None,
) -> LocalRedis:
    """Start a redis-server with no persistence on a free port and wait until it listens.

    With `tls_dir` (holding ca.crt, server.crt, server.key) the port speaks TLS only.
    """
    binary = redis_server_binary()
    port = port or free_port()
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"kvgate-redis-{port}-"))
    logfile = workdir / "redis.log"
    cmd = [
        binary,
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        "--logfile", str(logfile),
        "--maxmemory-policy", "noeviction",
    ]
    if tls_dir is not None:
        cmd += [
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", str(tls_dir / "server.crt"),
            "--tls-key-file", str(tls_dir / "server.key"),
            "--tls-ca-cert-file", str(tls_dir / "ca.crt"),
            "--tls-auth-clients", "no",
        ]
    else:
        cmd += ["--port", str(port)]
    if password:
        cmd += ["--requirepass", password]
    cmd += list(args)
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, process, logfile)
    except BaseException:
        process.kill()
        raise
    return LocalRedis(
        port=port,
        workdir=workdir,
        process=process,
        password=password,
        tls=tls_dir is not None,
        extra=list(args),
    )


@contextlib.contextmanager
def running_redis(**kwargs: object) -> Iterator[LocalRedis]:
    server = start_redis(**kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


def start_replica(primary: LocalRedis, *, args: Sequence[str] = ()) -> LocalRedis:
    """A replica of `primary` (same password), returned once its initial sync is done.

    The primary is told to start that sync at once (`repl-diskless-sync-delay 0`) instead of
    waiting 5 s for more replicas.
    """
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RedisBinaryMissing("redis-cli is not installed (Debian package redis-tools)")
    auth = ["-a", primary.password, "--no-auth-warning"] if primary.password else []
    subprocess.run([cli, "-p", str(primary.port), *auth, "config", "set",
                    "repl-diskless-sync-delay", "0"], check=True, capture_output=True, timeout=5)
    extra = ["--replicaof", "127.0.0.1", str(primary.port)]
    if primary.password:
        extra += ["--masterauth", primary.password]
    replica = start_redis(password=primary.password, args=[*extra, *args])
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = subprocess.run([cli, "-p", str(replica.port), *auth, "info", "replication"],
                              capture_output=True, text=True, timeout=5).stdout
        if "master_link_status:up" in info:
            return replica
        if time.monotonic() > deadline:
            replica.stop()
            raise TimeoutError(f"the replica on {replica.port} did not sync with the primary")
        time.sleep(0.05)


def start_sentinel(
    primary_port: int,
    *,
    name: str = "kvgate",
    quorum: int = 2,
    down_after_ms: int = 1_000,
    failover_timeout_ms: int = 10_000,
    password: str | None = None,
    primary_password: str | None = None,
) -> LocalRedis:
    """A Sentinel (`redis-server CONF --sentinel`) watching the primary on `primary_port` as
    `name`. It rewrites its own config file, so each one gets a directory of its own.

    `password`: the Sentinel's own (`requirepass`), which its clients must AUTH with.
    `primary_password`: the one it gives the primary (`sentinel auth-pass`); without it a
    primary that requires one answers the Sentinel's pings NOAUTH and is soon taken for down."""
    binary = redis_server_binary()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"kvgate-sentinel-{port}-"))
    logfile = workdir / "sentinel.log"
    conf = workdir / "sentinel.conf"
    conf.write_text(
        f"port {port}\n"
        "bind 127.0.0.1\n"
        f"dir {workdir}\n"
        f"logfile {logfile}\n"
        f"sentinel monitor {name} 127.0.0.1 {primary_port} {quorum}\n"
        f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
        f"sentinel failover-timeout {name} {failover_timeout_ms}\n"
        f"sentinel parallel-syncs {name} 1\n"
        + (f"requirepass {password}\n" if password else "")
        + (f"sentinel auth-pass {name} {primary_password}\n" if primary_password else "")
    )
    process = subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, process, logfile)
    except BaseException:
        process.kill()
        raise
    return LocalRedis(port=port, workdir=workdir, process=process, password=password)


@dataclass
class LocalCluster:
    """A Redis Cluster of `masters` primaries (no replicas) on loopback."""

    nodes: list[LocalRedis]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
            shutil.rmtree(node.workdir, ignore_errors=True)


def start_cluster(masters: int = 3) -> LocalCluster:
    """Start `masters` cluster-enabled servers and join them with `redis-cli --cluster create`."""
    nodes: list[LocalRedis] = []
    try:
        for _ in range(masters):
            port = free_cluster_port()
            nodes.append(start_redis(port=port, args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000",
            ]))
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisBinaryMissing("redis-cli is not installed (Debian package redis-tools)")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = [
                subprocess.run([cli, "-p", str(n.port), "cluster", "info"], capture_output=True,
                               text=True, timeout=5).stdout
                for n in nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return LocalCluster(nodes)

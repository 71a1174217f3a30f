"""Ending the requests a stuck node holds.

The pool's leader ejects a node whose engine holds requests while its /metrics page does not
change for `scheduler.stuck_after_ms` (scheduler.scrape): no new work goes there. The requests
the node already holds would each wait out `gateway.upstream_timeout_ms` of silence (10
minutes by default), and a VIP chat among them with it. Each gateway therefore reads, every
`renew_interval_ms` and only for a pool in which it has requests in flight, which nodes the
leader published as stuck (`nodes_out`), and ends its exchanges with them that have been silent
for `CUT_QUIET_S` or longer (gateway.nodeclient `NodeClient.cut`). Each client gets a 502
`upstream_stuck` that says it may send the request again (the node is out of the pool, so the
retry lands on another, and the closed connection tells the stuck one to drop it), or, in a
stream that had begun, an error event of that code; the task is cancelled and its reservation
returned, as for a timeout.

A failed read is counted (`kvgate_gateway_redis_errors_total{op="nodes_out"}`), logged once
per streak, and tried again at the next round: the requests then wait as they would without
this loop, until their own timeout at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from admission.errors import describe
from admission.failurelog import FailureLog
from admission.reads import NODE_STUCK
from gateway.metrics import GatewayMetrics
from gateway.nodeclient import NodeClient
from gateway.pools import PoolRuntime

log = logging.getLogger("kvgate.gateway")

CUT_QUIET_S = 1.0
"""An exchange with a stuck node is ended once it has received nothing for this long. A
stuck engine sends nothing at all, so the requests it holds qualify; one sent there just
before the ejection waits one more round. A node that recovers streams again at once (a step
is tens of milliseconds), so its streams are left alone; a whole answer on it is silent until
its end and may be ended within the round after the recovery, before the leader's next
publish says so (the client may send it again)."""


async def cut_stuck_requests(
    pools: Mapping[str, PoolRuntime],
    client: NodeClient,
    metrics: GatewayMetrics,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Every `interval_s` until `stop` is set: end the silent exchanges with the nodes of
    `pools` the leader published as stuck (module docstring)."""
    failing = {name: FailureLog(f"reading the stuck nodes of pool {name}", time.monotonic, log)
               for name in pools}
    while not stop.is_set():
        for name, pool in pools.items():
            if not any(client.busy(url) for url in pool.urls.values()):
                continue
            try:
                out = await pool.store.nodes_out()
            except Exception as exc:
                if stop.is_set():
                    return
                metrics.child(metrics.redis_errors, "nodes_out").inc()
                failing[name].failed(describe(exc))
                continue
            failing[name].succeeded()
            for node, reason in out.items():
                url = pool.url(node)
                if reason != NODE_STUCK or url is None:
                    continue
                ended = client.cut(url, CUT_QUIET_S, f"pool {name}'s leader judged node {node} "
                                   "stuck: its engine makes no progress")
                if ended:
                    log.warning("pool %s: node %s is stuck: ended %d requests it held",
                                name, node, ended)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)

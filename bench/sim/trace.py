"""An optional per-node trace: one JSON line per engine step and per finished request.

Prometheus histograms say *that* a node's TTFT tail grew; the trace says why, after the fact:
which steps a request waited through (how long each took, how many sequences and prefill
tokens it carried) and how busy the engine was when the request arrived. ``bench.burst.ttft`` joins
the traces with the load generator's per-request log on the request id the gateway forwards.

Lines (times in simulated seconds since the node started; ``"k"`` tells them apart):

* ``{"k": "s", "t": start, "d": duration, "n": sequences, "p": prefill tokens, "kv": usage}``
* ``{"k": "r", "id": request id, "prio": priority, "prompt": tokens, "out": tokens generated,
  "arr": arrival, "sched": first scheduled, "first": first token, "end": finished,
  "reason": finish reason, "run0": running at arrival, "wait0": waiting at arrival}``
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import orjson

from bench.sim.engine import SimRequest

_BUFFER_BYTES = 1 << 16


class NodeTrace:
    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] = path.open("ab", buffering=_BUFFER_BYTES)

    def step(self, start: float, duration: float, seqs: int, prefill: int, kv: float) -> None:
        self._write({"k": "s", "t": round(start, 6), "d": round(duration, 6), "n": seqs,
                     "p": prefill, "kv": round(kv, 5)})

    def request(self, req: SimRequest, running_at_arrival: int, waiting_at_arrival: int) -> None:
        self._write({"k": "r", "id": req.request_id, "prio": req.priority,
                     "prompt": req.prompt_tokens, "out": req.num_output, "arr": req.arrival,
                     "sched": req.first_scheduled, "first": req.first_token_time,
                     "end": req.finish_time, "reason": req.finish_reason,
                     "run0": running_at_arrival, "wait0": waiting_at_arrival})

    def _write(self, row: dict[str, object]) -> None:
        self._file.write(orjson.dumps(row) + b"\n")

    def close(self) -> None:
        self._file.close()

"""A simulated vLLM node: its OpenAI API, its /metrics, and its V1 engine's KV-cache behaviour.

Entry points:

* ``python -m bench.sim --port P --model NAME ...`` (bench.sim.cli)
* ``create_app(SimConfig(...))`` -> aiohttp Application (bench.sim.app)
* ``SimCluster.start([SimConfig(...), ...])`` / ``await start_cluster(...)``: nodes as child
  processes; ``serve_node(config)``: one node in the current loop (bench.sim.cluster)
"""

from bench.sim.app import SIM_REGISTRY, SIM_RUNNER, create_app
from bench.sim.cluster import LocalNode, SimCluster, SimNode, serve_node, start_cluster
from bench.sim.config import SimConfig
from bench.sim.engine import Engine, SimRequest
from bench.sim.protocol import OUTPUT_TOKENS_HEADER
from bench.sim.runner import NodeRunner
from bench.sim.timing import StepCosts, StepShape, step_seconds

__all__ = [
    "OUTPUT_TOKENS_HEADER",
    "SIM_REGISTRY",
    "SIM_RUNNER",
    "Engine",
    "LocalNode",
    "NodeRunner",
    "SimCluster",
    "SimConfig",
    "SimNode",
    "SimRequest",
    "StepCosts",
    "StepShape",
    "create_app",
    "serve_node",
    "start_cluster",
    "step_seconds",
]

"""The ray driver on a local cluster: throughput on 1 and 3 nodes, per-run overhead over the
local process driver, and how far behind the node streamed output reaches the caller.

All in one run, on one machine (every node is a raylet on this host, so 3 nodes share its
cores: more nodes add capacity, not CPU):

- per-run latency, interleaved run by run: ``local`` (the process driver in this process)
  and ``ray`` (the same run placed on a node): create + run ``true`` + destroy; the
  overhead is the difference of the medians;
- throughput: ``--runs`` sandboxed runs of ``true`` with ``--concurrency`` callers (threads
  of this process, one lifecycle manager), first on a 1-node cluster, then after adding 2
  nodes; each repeated ``--repeats`` times, the median reported;
- stream latency: a command prints its own clock; the caller's on_stdout callback notes
  when the line arrived (same host, same clock).

Usage: python benchmarks/ray.py [--runs N] [--concurrency C] [--repeats R] [--latency-runs N]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named ray.py: keep its directory off the path while Ray itself is imported.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, str(_HERE))

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from devs_sandbox import SandboxLifecycleConfig, SandboxLifecycleManager, override  # noqa: E402
from devs_sandbox.drivers.ray.driver import RayDriver  # noqa: E402
from devs_sandbox.models import SandboxOutcome  # noqa: E402

from _common import summarize, time_interleaved, write_report  # noqa: E402

SLOTS = "devs_sandbox_slots"
SLOTS_PER_NODE = 16


@dataclass
class Seen:
    """Where the runs went, which layers each node gave them, and how many failed."""

    nodes: Counter[str] = field(default_factory=Counter)
    layers: dict[str, set[str]] = field(default_factory=dict)  # node -> layers of every run
    failed: int = 0

    def add(self, other: Seen) -> None:
        self.nodes += other.nodes
        for node, layers in other.layers.items():
            self.layers[node] = self.layers.get(node, layers) & layers
        self.failed += other.failed


def throughput(
    manager: SandboxLifecycleManager, cfg: SandboxLifecycleConfig, runs: int, concurrency: int
) -> tuple[float, Seen]:
    seen = Seen()

    def one(_: int) -> SandboxOutcome:
        return manager.run_in_sandbox(["true"], cfg)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for outcome in pool.map(one, range(runs)):
            node = (outcome.node or "local")[:12]
            seen.nodes[node] += 1
            layers = set(outcome.isolation)
            seen.layers[node] = seen.layers.get(node, layers) & layers
            seen.failed += outcome.exit_code != 0
    return runs / (time.perf_counter() - start), seen


def stream_latency_ms(manager: SandboxLifecycleManager, cfg: SandboxLifecycleConfig) -> float:
    """Median over 20 lines of (arrival at the caller - the node's clock when printed)."""
    lags: list[float] = []

    def on_stdout(chunk: bytes) -> None:
        now = time.time()
        for line in chunk.decode().split():
            lags.append((now - float(line)) * 1000)

    script = (
        "import time\nfor _ in range(20):\n    print(time.time(), flush=True)\n    time.sleep(0.05)"
    )
    manager.run_in_sandbox(["python3", "-c", script], cfg, on_stdout=on_stdout)
    return statistics.median(lags)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=120, help="runs per throughput measurement")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-runs", type=int, default=30)
    args = ap.parse_args()

    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {SLOTS: SLOTS_PER_NODE},
            "include_dashboard": False,
        },
    )
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    one_node_start_s = time.perf_counter() - t0
    manager = SandboxLifecycleManager(store=None)
    local_cfg = SandboxLifecycleConfig()
    ray_cfg = override(local_cfg, driver="ray", ray={"address": cluster.address})
    try:
        first = manager.run_in_sandbox(["true"], ray_cfg)  # starts the head's host actor
        isolation = list(first.isolation)
        samples = time_interleaved(
            {
                "local": lambda: manager.run_in_sandbox(["true"], local_cfg),
                "ray": lambda: manager.run_in_sandbox(["true"], ray_cfg),
            },
            runs=args.latency_runs,
        )
        latency = {name: summarize(s) for name, s in samples.items()}
        overhead_ms = latency["ray"]["p50_ms"] - latency["local"]["p50_ms"]
        stream_ms = stream_latency_ms(manager, ray_cfg)

        def measure() -> dict[str, Any]:
            rates: list[float] = []
            local_rates: list[float] = []
            seen, local_seen = Seen(), Seen()
            for _ in range(args.repeats):  # interleaved: ray, then local, then ray ...
                rate, one_seen = throughput(manager, ray_cfg, args.runs, args.concurrency)
                rates.append(rate)
                seen.add(one_seen)
                rate, one_seen = throughput(manager, local_cfg, args.runs, args.concurrency)
                local_rates.append(rate)
                local_seen.add(one_seen)
            return {
                "runs_per_s": statistics.median(rates),
                "runs_per_s_all": [round(r, 1) for r in rates],
                "local_runs_per_s": statistics.median(local_rates),
                "local_runs_per_s_all": [round(r, 1) for r in local_rates],
                "runs_per_node": dict(seen.nodes),
                "layers_per_node": {n: sorted(v) for n, v in seen.layers.items()},
                "failed_runs": seen.failed,
                "local_failed_runs": local_seen.failed,
            }

        one = measure()
        t1 = time.perf_counter()
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={SLOTS: SLOTS_PER_NODE})
        cluster.wait_for_nodes()
        add_two_s = time.perf_counter() - t1
        # Every node's host actor (started here if not yet), with its node's layers.
        node_layers = {
            info.node_id[:12]: {
                "in_effect": sorted(m for m, why in info.layers.items() if not why),
                "missing": {m: why for m, why in info.layers.items() if why},
            }
            for info in RayDriver().nodes(ray_cfg)
        }
        manager.run_in_sandbox(["true"], ray_cfg)  # warm-up
        three = measure()
    finally:
        manager.shutdown()
        ray.shutdown()
        cluster.shutdown()

    print(f"isolation of the first run: {', '.join(isolation)}")
    for node, layers in node_layers.items():
        missing = "; ".join(f"{m}: {why}" for m, why in layers["missing"].items()) or "none"
        print(f"node {node}: layers {', '.join(layers['in_effect'])} (missing: {missing})")
    print(f"cluster: 1 node up in {one_node_start_s:.1f} s, 2 more in {add_two_s:.1f} s")
    print(f"{'case':<8}{'p50 ms':>10}{'p90 ms':>10}")
    for name, s in latency.items():
        print(f"{name:<8}{s['p50_ms']:>10.1f}{s['p90_ms']:>10.1f}")
    print(f"per-run overhead of the ray driver over the local driver: {overhead_ms:.1f} ms (p50)")
    print(f"streamed output reaches the caller {stream_ms:.2f} ms after the node printed it")
    for label, m in (("1 node", one), ("3 nodes", three)):
        print(
            f"throughput, {label}: {m['runs_per_s']:.1f} runs/s with {args.concurrency} callers "
            f"(local driver, same callers: {m['local_runs_per_s']:.1f}); "
            f"per node {m['runs_per_node']}; failed runs {m['failed_runs']} "
            f"(local {m['local_failed_runs']})"
        )
        for node, layers in m["layers_per_node"].items():
            print(f"  every run on {node} had: {', '.join(layers)}")
    path = write_report(
        "ray",
        {
            "ray_version": ray.__version__,
            "isolation": isolation,
            "node_layers": node_layers,
            "runs": args.runs,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "slots_per_node": SLOTS_PER_NODE,
            "latency": latency,
            "overhead_p50_ms": overhead_ms,
            "stream_latency_p50_ms": stream_ms,
            "throughput": {"1_node": one, "3_nodes": three},
            "cluster_start_s": {"1_node": one_node_start_s, "add_2_nodes": add_two_s},
        },
    )
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

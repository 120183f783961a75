"""A real multi-node Ray cluster on this host: Ray's own ``ray.cluster_utils.Cluster``, one
raylet per node (separate processes, separate object stores), about 7-20 s to start.

Nodes start in the host's namespaces (no ``ip netns exec``: it remounts /sys, and the
sandboxes would silently lose their cgroup layer; FACTS.md). One cluster per test module;
every Ray process it started is stopped through the cluster object (``shutdown``), never by
name. Host actors are detached and die with their node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SLOTS = "devs_sandbox_slots"


@dataclass
class RayCluster:
    """The cluster object, its address, and its nodes' ids in the order they were added."""

    cluster: Any
    address: str
    node_ids: list[str] = field(default_factory=list)
    handles: dict[str, Any] = field(default_factory=dict)  # node id -> the cluster's node

    def add(self, **resources: float) -> str:
        import ray

        before = {n["NodeID"] for n in ray.nodes()}
        handle = self.cluster.add_node(num_cpus=1, resources=resources)
        self.cluster.wait_for_nodes()
        node_id = _wait_for(
            lambda: next(
                (n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before),
                None,
            ),
            what="the new node to register",
        )
        self.node_ids.append(node_id)
        self.handles[node_id] = handle
        return node_id

    def remove(self, node_id: str) -> None:
        """Kill the node's raylet at once (as a crashed machine would go)."""
        self.cluster.remove_node(self.handles.pop(node_id), allow_graceful=False)


def _wait_for(probe: Callable[[], Any], *, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_cluster(head_resources: dict[str, float], *nodes: dict[str, float]) -> RayCluster:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": head_resources, "include_dashboard": False},
    )
    rc = RayCluster(cluster, cluster.address)
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        head = next(n["NodeID"] for n in ray.nodes() if n["Alive"])
        rc.node_ids.append(head)
        rc.handles[head] = cluster.head_node
        for resources in nodes:
            rc.add(**resources)
    except BaseException:
        stop_cluster(rc)
        raise
    return rc


def stop_cluster(rc: RayCluster) -> None:
    import ray

    ray.shutdown()
    rc.cluster.shutdown()


@pytest.fixture
def ray_db(tmp_path: Path) -> Path:
    return tmp_path / "violations.db"


@pytest.fixture(autouse=True)
def _no_inherited_ray_address() -> Iterator[None]:
    """A RAY_ADDRESS from the environment must not pick the cluster for us."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    yield
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


wait_for = _wait_for

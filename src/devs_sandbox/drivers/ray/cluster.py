"""The caller's view of the cluster: the connection, the host actors, and the verdict on a
node that stopped answering.

Ray is one connection per process. Inside a Ray task or actor it already exists and is
used as it is; otherwise the first sandbox connects (``sandbox.ray.address``) and
``RayDriver.close`` disconnects only what it connected.

Host actors are named (``wire.host_actor_name``), detached and pinned to their node with a
hard node-affinity strategy; the first caller to need one creates it (``get_if_exists``
makes concurrent callers agree on one), later callers and later processes find it by name.
They take no CPU from Ray's accounting: the sandbox's own slot is what counts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Final

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from devs_sandbox import __version__
from devs_sandbox.config import RayConfig
from devs_sandbox.drivers.ray.host import CONTROL_THREADS, WORK_THREADS, SandboxHost
from devs_sandbox.drivers.ray.wire import NodeInfo, Reply, host_actor_name, short_node
from devs_sandbox.errors import DriverError, DriverUnavailableError

logger = logging.getLogger(__name__)

NODE_DEATH_CONFIRM_S: Final = 3.0  # after a broken call, how long the GCS may take to agree
NODE_POLL_S: Final = 0.25
PROBE_TIMEOUT_S: Final = 1.0  # a live raylet accepts a TCP connection at once

_HostActor: Any = None
_actor_lock = threading.Lock()


def _host_actor_class() -> Any:
    global _HostActor  # noqa: PLW0603 - one actor class per process, made on first use
    with _actor_lock:
        if _HostActor is None:
            remote: Any = ray.remote  # its stubs lack concurrency_groups
            _HostActor = remote(
                num_cpus=0,
                max_restarts=0,  # a restarted actor would not know its sandboxes: none
                concurrency_groups={"work": WORK_THREADS, "control": CONTROL_THREADS},
            )(SandboxHost)
        return _HostActor


class Cluster:
    """Connection and host actors for one ``RayConfig``."""

    def __init__(self, config: RayConfig) -> None:
        self.config = config
        self.owns_connection = False
        self._hosts: dict[str, tuple[Any, NodeInfo]] = {}
        self._lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------
    def connect(self) -> None:
        if ray.is_initialized():
            return
        address = self.config.address
        options: dict[str, Any] = {
            "log_to_driver": False,  # the nodes' worker logs are theirs, not our stderr
            "configure_logging": False,
        }
        try:
            if address == "local":
                slots = float(os.cpu_count() or 1)
                ray.init(
                    resources={self.config.slot_resource: slots},
                    include_dashboard=False,
                    **options,
                )
            else:
                ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
            raise DriverUnavailableError(
                f"cannot connect to the Ray cluster at {address!r} (sandbox.ray.address, "
                f"--ray-address): {exc}"
            ) from exc
        self.owns_connection = True

    def close(self) -> None:
        with self._lock:
            self._hosts.clear()
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()
        self.owns_connection = False

    # -- host actors -----------------------------------------------------------------------
    def host(self, node_id: str) -> tuple[Any, NodeInfo]:
        """The host actor of ``node_id`` (started there if it is not running) and what it
        says about its node."""
        with self._lock:
            known = self._hosts.get(node_id)
        if known is not None:
            return known
        node_driver = self.config.node_driver
        name = host_actor_name(__version__, node_driver, node_id)
        handle = (
            _host_actor_class()
            .options(
                name=name,
                namespace=self.config.namespace,
                lifetime="detached",  # outlives this process: later callers find it by name
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(node_driver, node_id)
        )
        ref = handle.info.remote()
        try:
            done, _ = ray.wait([ref], timeout=self.config.connect_timeout_s)
            if not done:
                raise DriverUnavailableError(
                    f"the devs-sandbox host actor on Ray node {short_node(node_id)} did not "
                    f"start within {self.config.connect_timeout_s:g} s "
                    "(sandbox.ray.connectTimeoutS)"
                )
            reply: Reply = ray.get(done[0])
        except RayActorError as exc:
            raise DriverUnavailableError(
                f"the devs-sandbox host actor on Ray node {short_node(node_id)} could not "
                f"start: {_first_line(exc)} (is devs-sandbox installed in that node's Python?)"
            ) from exc
        if reply.error is not None:
            raise DriverError(f"Ray node {short_node(node_id)}: {reply.error.message}")
        info: NodeInfo = reply.value
        with self._lock:
            self._hosts[node_id] = (handle, info)
        return handle, info

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._hosts.pop(node_id, None)

    def known_hosts(self) -> list[tuple[Any, NodeInfo]]:
        with self._lock:
            return list(self._hosts.values())

    def slot_nodes(self) -> list[str]:
        """Ids of the live nodes that declare the slot resource."""
        resource = self.config.slot_resource
        return [
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive") and float(n.get("Resources", {}).get(resource, 0)) > 0
        ]

    # -- loss ----------------------------------------------------------------------------
    def explain_loss(self, node_id: str, exc: BaseException | None) -> str:
        """Why calls to ``node_id`` broke, from the best witness at hand: the GCS's node
        table if it already declared the node dead; else the node's raylet port (refused:
        the node is down, Ray just has not noticed yet; silent: unreachable, and we give
        the GCS ``NODE_DEATH_CONFIRM_S`` to agree); else what Ray said of the call."""
        alive, why, address = node_state(node_id)
        if not alive:
            return f"the node died ({why})"
        said = _first_line(exc) if exc is not None else "no answer"
        if address is None:
            return f"its host actor stopped answering ({said})"
        reach = _probe(address)
        if reach == "refused":
            return (
                f"the node is down: its raylet at {address[0]}:{address[1]} refuses "
                "connections (Ray has not declared it dead yet)"
            )
        if reach == "silent":
            deadline = time.monotonic() + NODE_DEATH_CONFIRM_S
            while time.monotonic() < deadline:
                alive, why, _ = node_state(node_id)
                if not alive:
                    return f"the node died ({why})"
                time.sleep(NODE_POLL_S)
            return f"the node is unreachable (its raylet at {address[0]}:{address[1]} is silent)"
        return f"its host actor died or stopped answering while the node lives ({said})"


def node_state(node_id: str) -> tuple[bool, str, tuple[str, int] | None]:
    """(alive, why not, the raylet's address) from the GCS's node table."""
    try:
        nodes = ray.nodes()
    except Exception as exc:
        return True, f"the GCS did not answer: {exc}", None
    for n in nodes:
        if n.get("NodeID") == node_id:
            address = (str(n.get("NodeManagerAddress")), int(n.get("NodeManagerPort") or 0))
            if n.get("Alive"):
                return True, "", address if address[1] else None
            return False, str(n.get("DeathReasonMessage") or "its raylet stopped"), address
    return False, "it left the cluster", None


def _probe(address: tuple[str, int]) -> str:
    """ "open", "refused" (nothing listens: the raylet is gone) or "silent" (no answer)."""
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def _first_line(exc: BaseException | None) -> str:
    text = str(exc or "").strip().splitlines()
    return text[0][:300] if text else type(exc).__name__

"""``RayDriver``: sandboxes placed on the nodes of a Ray cluster, confined there by each
node's own local driver.

Ray decides where (``placement``), devs-sandbox decides how a sandbox is confined (the
node's process or docker driver, inside the node's host actor, ``host``). Everything
else stays with the caller, as with a local driver: the lifecycle's total timeout, the
drain detector's samples and verdicts, the violation store. A sandbox is pinned to the
node that provisioned it; every later call goes to that node's host actor.

Loss, never a hang: every call to a node is a Ray call waited on in slices. A call that
breaks (the actor's process or its node died: ``RayActorError``) or that gets no answer
within its bound turns the sandbox into a lost one: ``SandboxLostError`` naming the node
and the reason, raised by that call and by every later exec; samples then say
``SandboxNotFoundError`` (so the drain detector stops), kills and destroy do nothing but
give the slot back. Bounds: an exec, the sandbox's total timeout plus ``EXEC_GRACE_S``
(``KILL_GRACE_S`` once a kill was asked); anything else, ``CONTROL_TIMEOUT_S``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import ray
from ray.exceptions import RayActorError, RayError

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import RayConfig, SandboxLifecycleConfig
from devs_sandbox.drivers.ray.cluster import Cluster
from devs_sandbox.drivers.ray.placement import Slot, SlotPlacement
from devs_sandbox.drivers.ray.wire import (
    STDERR,
    STDOUT,
    NodeInfo,
    Reply,
    StreamWants,
    pack_directory,
    short_node,
)
from devs_sandbox.errors import (
    DiskQuotaExceededError,
    DriverError,
    DriverUnavailableError,
    QuotaExceededError,
    SandboxLostError,
    SandboxNotFoundError,
)
from devs_sandbox.leases import _boot_id
from devs_sandbox.models import (
    ExecResult,
    SandboxContext,
    SandboxMetrics,
    ViolationType,
    new_sandbox_id,
    validate_sandbox_id,
)
from devs_sandbox.security.session_keys import wipe

logger = logging.getLogger(__name__)

WAIT_SLICE_S: Final = 1.0  # how often a waiting call looks at its bound
CONTROL_TIMEOUT_S: Final = 30.0  # a live node answers a kill, sample or destroy in ms
EXEC_GRACE_S: Final = 30.0  # past the total timeout, an exec's answer is overdue
KILL_GRACE_S: Final = 30.0  # after a kill was asked, the exec it ended is overdue


@dataclass
class _Placed:
    sandbox_id: str
    host: Any  # the node's host actor
    node: NodeInfo
    slot: Slot
    total_timeout_s: float
    opened: float
    same_kernel: bool  # the node shares this process's kernel (host pids mean something)
    ctx: SandboxContext | None = None  # once provisioned
    kill_at: float | None = None
    lost: SandboxLostError | None = None


class RayDriver:
    """Places each sandbox on a node of the Ray cluster named by ``sandbox.ray``."""

    name = "ray"

    def __init__(self, *, emit: Emit | None = None, config: RayConfig | None = None) -> None:
        self._emit = emit
        self._default = config
        self._clusters: dict[str, Cluster] = {}
        self._placement = SlotPlacement(emit)
        self._placed: dict[str, _Placed] = {}
        self._lock = threading.Lock()

    # -- cluster ---------------------------------------------------------------------------
    def cluster(self, config: RayConfig | None = None) -> Cluster:
        """The connected cluster for ``config`` (connecting on first use)."""
        cfg = config or self._default or RayConfig()
        key = cfg.model_dump_json()
        with self._lock:
            cluster = self._clusters.get(key)
            if cluster is None:
                cluster = self._clusters[key] = Cluster(cfg)
        cluster.connect()
        return cluster

    def nodes(self, config: SandboxLifecycleConfig | None = None) -> list[NodeInfo]:
        """Every node that offers sandbox slots, as its host actor reports it (starting the
        host actors that are not running yet, which reap their node's leftovers)."""
        cluster = self.cluster(config.ray if config is not None else None)
        return [cluster.host(node_id)[1] for node_id in cluster.slot_nodes()]

    # -- provision -------------------------------------------------------------------------
    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """Reserve a slot (waiting at most the total timeout), then create the sandbox with
        the local driver of the node Ray chose."""
        sandbox_id = validate_sandbox_id(config.sandbox_id or new_sandbox_id())
        rc = config.ray
        cluster = self.cluster(rc)
        copy_in = (
            pack_directory(config.copy_in, config.quotas.disk_bytes)
            if config.copy_in is not None
            else None
        )
        node_config = config.model_copy(update={"sandbox_id": sandbox_id, "copy_in": None})
        slot = self._placement.acquire(sandbox_id, rc.slot_resource, config.timeout_ms)
        payload = {name: bytearray(value) for name, value in (secrets or {}).items()}
        try:
            host, info = cluster.host(slot.node_id)
            total_s = config.timeout_ms / 1000
            placed = _Placed(
                sandbox_id=sandbox_id,
                host=host,
                node=info,
                slot=slot,
                total_timeout_s=total_s,
                opened=time.monotonic(),
                same_kernel=bool(info.boot_id) and info.boot_id == _boot_id(),
            )
            ref = host.provision.remote(node_config, payload, copy_in, slot.group, total_s)
            reply = self._await(placed, ref, lambda: placed.opened + total_s + EXEC_GRACE_S)
            node_ctx: SandboxContext = self._value(placed, reply)
        except BaseException:
            self._placement.release(slot.group)
            raise
        finally:
            wipe(payload.values())
        labels = {
            **node_ctx.labels,
            "node": info.node_id,
            "node_ip": info.ip,
            "node_hostname": info.hostname,
            "node_driver": rc.node_driver,
            "queued_ms": str(round(slot.waited_s * 1000)),
        }
        ctx = dataclasses.replace(node_ctx, driver=self.name, labels=labels)
        placed.ctx = ctx
        with self._lock:
            self._placed[sandbox_id] = placed
        return ctx

    # -- exec ------------------------------------------------------------------------------
    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        placed = self._live(ctx)
        wants = StreamWants(
            stdout=request.on_stdout is not None,
            stderr=request.on_stderr is not None,
            # A host pid means something here only when the node shares our kernel.
            start=request.on_start is not None and placed.same_kernel,
        )
        bare = request.replace(on_stdout=None, on_stderr=None, on_start=None)
        if not wants.any:
            ref = placed.host.exec.remote(ctx.id, bare)
            reply = self._await(placed, ref, lambda: self._exec_limit(placed))
        else:
            reply = self._stream(placed, bare, wants, request)
        result: ExecResult = self._value(placed, reply)
        return result

    def _exec_limit(self, placed: _Placed) -> float:
        limit = placed.opened + placed.total_timeout_s + EXEC_GRACE_S
        if placed.kill_at is not None:
            limit = min(limit, placed.kill_at + KILL_GRACE_S)
        return limit

    def _stream(
        self, placed: _Placed, bare: ExecRequest, wants: StreamWants, request: ExecRequest
    ) -> Reply:
        """Run the exec as a streaming generator on the node and call the request's callbacks
        with its frames as they arrive (about a millisecond behind the node's exec loop)."""
        stream = placed.host.exec_stream.remote(placed.sandbox_id, bare, wants)
        callbacks: dict[int, Callable[[bytes], None] | None] = {
            STDOUT: request.on_stdout,
            STDERR: request.on_stderr,
        }
        while True:
            try:
                ready, _ = ray.wait([stream], timeout=WAIT_SLICE_S)
                if not ready:
                    if time.monotonic() > self._exec_limit(placed):
                        raise self._lose(placed, None, overdue=True)
                    continue
                try:
                    ref = next(stream)
                except StopIteration:
                    raise DriverError(
                        f"Ray node {short_node(placed.node.node_id)}: the exec's stream "
                        "ended without a result"
                    ) from None
                batch = ray.get(ref)
            except RayActorError as exc:
                raise self._lose(placed, exc) from exc
            except RayError as exc:
                raise DriverError(f"Ray failed the exec: {exc}") from exc
            for frame in batch:
                kind = frame[0]
                if kind == "end":
                    end: Reply = frame[1]
                    return end
                try:
                    if kind == "out":
                        cb = callbacks.get(frame[1])
                        if cb is not None:
                            cb(frame[2])
                    elif kind == "start" and request.on_start is not None:
                        request.on_start(frame[1])
                except Exception:
                    logger.exception("%s callback failed", kind)

    # -- observe / stop --------------------------------------------------------------------
    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        placed = self._known(ctx)
        if placed.lost is not None:
            # The drain detector stops polling on this; the exec reports the loss.
            raise SandboxNotFoundError(ctx.id, f"lost with Ray node {placed.lost.node}")
        metrics: SandboxMetrics = self._control(placed, placed.host.get_metrics.remote(ctx.id))
        return metrics

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            placed = self._placed.get(ctx.id)
        if placed is None or placed.lost is not None:
            return False
        try:
            running: bool = self._control(placed, placed.host.is_running.remote(ctx.id))
        except SandboxLostError:
            return False
        return running

    def member_pids(self, ctx: SandboxContext) -> list[int]:
        """The sandbox's host pids, only where they mean something: a node on our kernel."""
        with self._lock:
            placed = self._placed.get(ctx.id)
        if placed is None or placed.lost is not None or not placed.same_kernel:
            return []
        pids: list[int] = self._control(placed, placed.host.member_pids.remote(ctx.id))
        return pids

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every process of the sandbox on its node. A lost sandbox has nothing left
        to kill: a no-op."""
        with self._lock:
            placed = self._placed.get(ctx.id)
        if placed is None or placed.lost is not None:
            return
        placed.kill_at = time.monotonic()
        try:
            self._control(placed, placed.host.force_stop.remote(ctx.id))
        except SandboxLostError as exc:
            logger.warning("%s", exc)

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        """Hand the violation to the node's driver (Docker releases a full workspace)."""
        with self._lock:
            placed = self._placed.get(ctx.id)
        if placed is None or placed.lost is not None:
            return
        disk = isinstance(error, DiskQuotaExceededError) or (
            error.violation.type == ViolationType.DISK_QUOTA_EXCEEDED
        )
        self._control(placed, placed.host.on_quota_exceeded.remote(ctx.id, error.violation, disk))

    def destroy(self, ctx: SandboxContext) -> None:
        """Destroy on the node and give the slot back; idempotent. For a lost sandbox only
        the slot: its node's leftovers are the reaper's when a node starts there again."""
        with self._lock:
            placed = self._placed.pop(ctx.id, None)
        if placed is None:
            return
        try:
            if placed.lost is None:
                self._control(placed, placed.host.destroy.remote(ctx.id))
        except SandboxLostError as exc:
            logger.warning("%s", exc)
        finally:
            self._placement.release(placed.slot.group)

    # -- reports ---------------------------------------------------------------------------
    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" when every node offering slots gives it for ``config``, else which
        nodes do not and why."""
        cluster = self.cluster(config.ray)
        merged: dict[str, list[str]] = {}
        for node_id in cluster.slot_nodes():
            host, _info = cluster.host(node_id)
            report: dict[str, str] = _call(host.isolation_report.remote(config), node_id)
            for mechanism, why in report.items():
                bucket = merged.setdefault(mechanism, [])
                if why:
                    bucket.append(f"node {short_node(node_id)}: {why}")
        return {m: "; ".join(whys) for m, whys in merged.items()}

    def reap_orphans(self) -> list[str]:
        """Ask the host actors this driver knows to reap their nodes now (each also reaps
        when it starts); nothing to do before the first connection."""
        reaped: list[str] = []
        for cluster in list(self._clusters.values()):
            for host, info in cluster.known_hosts():
                try:
                    reply: Reply = ray.get(host.reap.remote(), timeout=CONTROL_TIMEOUT_S)
                except (RayError, TimeoutError) as exc:
                    logger.warning("reaping on node %s failed: %s", short_node(info.node_id), exc)
                    continue
                if reply.error is None:
                    reaped += list(reply.value)
        return reaped

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        """Nodes may differ and the check runs before every exec: not told (None)."""
        del config
        return None

    def close(self) -> None:
        """Disconnect from clusters this driver connected to (never from the one a Ray task
        runs in). Live sandboxes are the lifecycle's to destroy before this."""
        with self._lock:
            clusters = list(self._clusters.values())
            self._clusters.clear()
        for cluster in clusters:
            cluster.close()

    # -- calls -----------------------------------------------------------------------------
    def _known(self, ctx: SandboxContext) -> _Placed:
        with self._lock:
            placed = self._placed.get(ctx.id)
        if placed is None:
            raise SandboxNotFoundError(ctx.id)
        return placed

    def _live(self, ctx: SandboxContext) -> _Placed:
        placed = self._known(ctx)
        if placed.lost is not None:
            raise placed.lost
        return placed

    def _control(self, placed: _Placed, ref: Any) -> Any:
        limit = time.monotonic() + CONTROL_TIMEOUT_S
        return self._value(placed, self._await(placed, ref, lambda: limit))

    def _await(self, placed: _Placed, ref: Any, limit: Callable[[], float]) -> Reply:
        """The call's reply; ``SandboxLostError`` if the node broke it or let it pass
        ``limit()`` unanswered."""
        while True:
            try:
                done, _ = ray.wait([ref], timeout=WAIT_SLICE_S)
                if done:
                    reply: Reply = ray.get(done[0])
                    return reply
            except RayActorError as exc:
                raise self._lose(placed, exc) from exc
            except RayError as exc:
                raise DriverError(f"Ray failed a call to the host actor: {exc}") from exc
            if time.monotonic() > limit():
                ray.cancel(ref, force=False)
                raise self._lose(placed, None, overdue=True)

    def _value(self, placed: _Placed, reply: Reply) -> Any:
        for name, payload in reply.events:
            if self._emit is not None:
                try:
                    self._emit(name, {**payload, "node": placed.node.node_id})
                except Exception:
                    logger.exception("re-emitting node event %s failed", name)
        if reply.error is not None:
            raise reply.error.rebuild(f"Ray node {short_node(placed.node.node_id)}")
        return reply.value

    def _lose(
        self, placed: _Placed, exc: BaseException | None, *, overdue: bool = False
    ) -> SandboxLostError:
        node_id = placed.node.node_id
        if placed.lost is not None:
            return placed.lost
        cluster = self.cluster()
        for c in self._clusters.values():
            c.forget(node_id)
        if overdue:
            reason = "its host actor did not answer in time (the node is unreachable or stuck)"
        else:
            reason = cluster.explain_loss(node_id, exc)
        where = f"{placed.node.hostname or '?'} {placed.node.ip}".strip()
        placed.lost = SandboxLostError(placed.sandbox_id, node_id, f"{reason} [{where}]")
        logger.warning("%s", placed.lost)
        return placed.lost


def _call(ref: Any, node_id: str) -> Any:
    """A call that concerns a node, not a sandbox (reports): its value, or the error."""
    where = f"Ray node {short_node(node_id)}"
    try:
        reply: Reply = ray.get(ref, timeout=CONTROL_TIMEOUT_S)
    except (RayError, TimeoutError) as exc:
        raise DriverUnavailableError(f"{where} did not answer: {exc}") from exc
    if reply.error is not None:
        raise reply.error.rebuild(where)
    return reply.value

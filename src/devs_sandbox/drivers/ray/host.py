"""The node side: one long-lived host actor per node wraps that node's local driver.

The actor is the only thing of ours on the node. It provisions, runs, samples, kills and
destroys sandboxes with the node's own process (or docker) driver, exactly as a local run
would, and answers with the library's plain records (``wire.Reply``). It decides nothing
about limits: the caller's lifecycle watches quotas and the total timeout, records
violations in its own store and tells the actor to kill.

Why one actor per node and not one per sandbox: an actor is a worker process (about
0.7 s to start, ~100 MB); a sandbox through a live actor costs a few milliseconds.
Capacity is not the actor's business either: the caller reserves a slot (a placement
group of one bundle of the slot resource) before it asks this actor for a sandbox.

Invariants kept here:

- **A kill never waits behind work.** Methods run on two thread pools (Ray concurrency
  groups): ``work`` (provision, exec, destroy) and ``control`` (force_stop, metrics,
  info); a node busy with execs still answers a kill at once.
- **What a dead caller leaves is destroyed.** A sandbox whose caller vanished without
  destroying it is destroyed by the backstop thread when its slot's placement group is
  removed (Ray removes it when its creator dies) or when its total timeout plus
  ``BACKSTOP_GRACE_S`` has passed.
- **What a dead node leaves is reaped.** When the actor starts (on a new node, or a
  replacement on the same host) it runs the local driver's reaper: sandboxes whose owner
  (a previous host actor's process) is dead are destroyed, cgroups, mounts, workspaces
  and leases alike. ``NodeInfo.reaped_at_start`` lists them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import ray

from devs_sandbox import __version__
from devs_sandbox.base import ExecRequest, SandboxDriver
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers import create_driver, exec_io
from devs_sandbox.drivers.ray.wire import (
    STDERR,
    STDOUT,
    Frame,
    NodeInfo,
    RemoteError,
    Reply,
    StreamWants,
    coalesce,
    unpack_directory,
)
from devs_sandbox.errors import (
    DiskQuotaExceededError,
    QuotaExceededError,
    SandboxNotFoundError,
)
from devs_sandbox.leases import _boot_id
from devs_sandbox.models import SandboxContext, Violation
from devs_sandbox.security.session_keys import wipe

logger = logging.getLogger(__name__)
T = TypeVar("T")

WORK_THREADS: Final = 256  # concurrent provisions/execs/destroys one node serves (eager threads)
CONTROL_THREADS: Final = 8  # kills and samples, never queued behind work
BACKSTOP_TICK_S: Final = 5.0  # how often abandoned sandboxes are looked for
BACKSTOP_GRACE_S: Final = 60.0  # past its total timeout, a sandbox nobody destroyed is
STREAM_BUFFER_BYTES: Final = 8 * 2**20  # output held for a slow caller before the exec waits
STREAM_BACKPRESSURE_OBJECTS: Final = 16  # batches yielded but not yet taken by the caller
STREAM_STALL_S: Final = 30.0  # a caller that takes nothing for this long loses the rest
EVENTS_KEPT: Final = 64  # per sandbox, until its caller next hears from us


@dataclass
class _Hosted:
    ctx: SandboxContext
    deadline: float  # time.monotonic() past which nobody can still want this sandbox
    slot: Any  # the caller's PlacementGroup, or None
    copy_in: Path | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class SandboxHost:
    """The host actor's class (``ray.remote`` is applied by the driver). Plain Python: a
    test can build one in-process around the fake driver."""

    def __init__(
        self,
        node_driver: str,
        node_id: str,
        *,
        driver: SandboxDriver | None = None,
        backstop: bool = True,
    ) -> None:
        self.node_driver = node_driver
        self.node_id = node_id
        self._lock = threading.Lock()
        self._hosted: dict[str, _Hosted] = {}
        self._orphan_events: list[tuple[str, dict[str, Any]]] = []
        self.driver = driver or create_driver(node_driver, emit=self._on_event)
        # Leftovers of a host actor that died with its node (same host, same lease dir).
        self.reaped_at_start = tuple(self._reap())
        self._stop = threading.Event()
        if backstop:
            threading.Thread(
                target=self._backstop, name="devs-sandbox-backstop", daemon=True
            ).start()

    # -- helpers --------------------------------------------------------------------------
    def _reply(self, sandbox_id: str | None, fn: Callable[[], T]) -> Reply:
        try:
            value: Any = fn()
            error = None
        except Exception as exc:
            logger.debug("host call failed", exc_info=True)
            value, error = None, RemoteError.capture(exc)
        return Reply(value, error, self._take_events(sandbox_id))

    def _take_events(self, sandbox_id: str | None) -> tuple[tuple[str, dict[str, Any]], ...]:
        with self._lock:
            hosted = self._hosted.get(sandbox_id) if sandbox_id else None
            if hosted is None or not hosted.events:
                return ()
            events, hosted.events = hosted.events, []
        return tuple(events)

    def _on_event(self, name: str, payload: dict[str, Any]) -> None:
        """The local driver's own facts (a Docker OOM event), kept for the sandbox they are
        about until its caller's next call."""
        with self._lock:
            target = None
            sid = payload.get("sandbox_id")
            container = payload.get("container_id")
            for hosted in self._hosted.values():
                if hosted.ctx.id == sid or (
                    container and hosted.ctx.labels.get("container_id") == container
                ):
                    target = hosted
                    break
            if target is not None and len(target.events) < EVENTS_KEPT:
                target.events.append((name, dict(payload)))
            elif target is None:
                logger.info("node event for no hosted sandbox: %s %s", name, payload)

    def _ctx(self, sandbox_id: str) -> SandboxContext:
        with self._lock:
            hosted = self._hosted.get(sandbox_id)
        if hosted is None:
            raise SandboxNotFoundError(sandbox_id, "not hosted on this node")
        return hosted.ctx

    def _reap(self) -> list[str]:
        try:
            return self.driver.reap_orphans()
        except Exception:
            logger.exception("reaping orphaned sandboxes on this node failed")
            return []

    def _node_config(
        self, config: SandboxLifecycleConfig, copy_in: Path | None
    ) -> SandboxLifecycleConfig:
        return config.model_copy(update={"driver": self.node_driver, "copy_in": copy_in})

    # -- control group ------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def info(self) -> Reply:
        def make() -> NodeInfo:
            layers: dict[str, str] = {}
            layers_error = ""
            try:
                layers = self.driver.isolation_report(SandboxLifecycleConfig())
            except Exception as exc:
                layers_error = f"{type(exc).__name__}: {exc}"
            hostname = socket.gethostname()
            try:
                ip = ray.util.get_node_ip_address()
            except Exception:
                ip = ""
            return NodeInfo(
                node_id=self.node_id,
                hostname=hostname,
                ip=ip,
                boot_id=_boot_id(),
                host_pid=os.getpid(),
                node_driver=self.node_driver,
                version=__version__,
                reaped_at_start=self.reaped_at_start,
                layers=layers,
                layers_error=layers_error,
            )

        return self._reply(None, make)

    @ray.method(concurrency_group="control")
    def isolation_report(self, config: SandboxLifecycleConfig) -> Reply:
        return self._reply(
            None, lambda: self.driver.isolation_report(self._node_config(config, None))
        )

    @ray.method(concurrency_group="control")
    def get_metrics(self, sandbox_id: str) -> Reply:
        return self._reply(sandbox_id, lambda: self.driver.get_metrics(self._ctx(sandbox_id)))

    @ray.method(concurrency_group="control")
    def is_running(self, sandbox_id: str) -> Reply:
        def running() -> bool:
            with self._lock:
                hosted = self._hosted.get(sandbox_id)
            return hosted is not None and self.driver.is_running(hosted.ctx)

        return self._reply(sandbox_id, running)

    @ray.method(concurrency_group="control")
    def member_pids(self, sandbox_id: str) -> Reply:
        return self._reply(sandbox_id, lambda: self.driver.member_pids(self._ctx(sandbox_id)))

    @ray.method(concurrency_group="control")
    def force_stop(self, sandbox_id: str) -> Reply:
        def stop() -> None:
            with self._lock:
                hosted = self._hosted.get(sandbox_id)
            if hosted is not None:
                self.driver.force_stop(hosted.ctx)

        return self._reply(sandbox_id, stop)

    @ray.method(concurrency_group="control")
    def on_quota_exceeded(self, sandbox_id: str, violation: Violation, disk: bool) -> Reply:
        error = DiskQuotaExceededError(violation) if disk else QuotaExceededError(violation)
        return self._reply(
            sandbox_id, lambda: self.driver.on_quota_exceeded(self._ctx(sandbox_id), error)
        )

    @ray.method(concurrency_group="control")
    def hosted(self) -> list[str]:
        with self._lock:
            return sorted(self._hosted)

    # -- work group ---------------------------------------------------------------------
    @ray.method(concurrency_group="work")
    def provision(
        self,
        config: SandboxLifecycleConfig,
        secrets: dict[str, bytearray],
        copy_in: bytes | None,
        slot: Any,
        lifetime_s: float,
    ) -> Reply:
        """Create the sandbox with the node's driver; ``lifetime_s`` (its total timeout) and
        ``slot`` arm the backstop."""

        def make() -> SandboxContext:
            workdir: Path | None = None
            try:
                if copy_in is not None:
                    workdir = Path(tempfile.mkdtemp(prefix="devs-ray-copy-in."))
                    unpack_directory(copy_in, workdir)
                ctx = self.driver.provision(self._node_config(config, workdir), secrets=secrets)
            except BaseException:
                if workdir is not None:
                    shutil.rmtree(workdir, ignore_errors=True)
                raise
            finally:
                wipe(v for v in secrets.values() if isinstance(v, bytearray))
            ctx = dataclasses.replace(ctx, labels={**ctx.labels, "node": self.node_id})
            hosted = _Hosted(ctx, time.monotonic() + lifetime_s + BACKSTOP_GRACE_S, slot, workdir)
            with self._lock:
                self._hosted[ctx.id] = hosted
            return ctx

        return self._reply(None, make)

    @ray.method(concurrency_group="work")
    def exec(self, sandbox_id: str, request: ExecRequest) -> Reply:
        return self._reply(sandbox_id, lambda: self.driver.exec(self._ctx(sandbox_id), request))

    @ray.method(
        concurrency_group="work",
        num_returns="streaming",
        _generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS,
    )
    def exec_stream(
        self, sandbox_id: str, request: ExecRequest, wants: StreamWants
    ) -> Iterator[list[Frame]]:
        """The exec, with its output and start streamed back as it happens (a Ray streaming
        generator): batches of frames, the last one ``("end", Reply)``.

        The exec runs on its own thread and hands frames over through a buffer of
        ``STREAM_BUFFER_BYTES``: when the caller falls behind, the exec's output callbacks
        wait (the command then blocks on its pipe, as with a slow local reader), but never
        longer than ``STREAM_STALL_S``; after that, output is no longer forwarded (the
        result still holds its head and tail) so a vanished caller cannot wedge the exec.
        """
        frames: queue.Queue[Frame] = queue.Queue()
        space = threading.Semaphore(STREAM_BUFFER_BYTES // exec_io.READ_CHUNK)  # chunks
        stalled = threading.Event()

        def forward(stream: int) -> Callable[[bytes], None]:
            def put(chunk: bytes) -> None:
                if stalled.is_set():
                    return
                if not space.acquire(timeout=STREAM_STALL_S):
                    stalled.set()
                    logger.warning("sandbox %s: caller stopped reading its output", sandbox_id)
                    return
                frames.put(("out", stream, chunk))

            return put

        def started(pid: int) -> None:
            frames.put(("start", pid))

        local = request.replace(
            on_stdout=forward(STDOUT) if wants.stdout else None,
            on_stderr=forward(STDERR) if wants.stderr else None,
            on_start=started if wants.start else None,
        )

        def run() -> None:
            reply = self._reply(sandbox_id, lambda: self.driver.exec(self._ctx(sandbox_id), local))
            frames.put(("end", reply))

        threading.Thread(target=run, name=f"devs-sandbox-exec-{sandbox_id}", daemon=True).start()
        while True:
            batch = [frames.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 256:
                    batch.append(frames.get_nowait())
            for frame in batch:
                if frame[0] == "out":
                    space.release()
            yield coalesce(batch)
            if batch[-1][0] == "end":  # always the last frame the exec thread puts
                return

    @ray.method(concurrency_group="work")
    def destroy(self, sandbox_id: str) -> Reply:
        return self._destroy(sandbox_id)

    def _destroy(self, sandbox_id: str) -> Reply:
        def remove() -> None:
            with self._lock:
                hosted = self._hosted.get(sandbox_id)
            if hosted is None:
                return  # destroyed already (by its caller or the backstop): idempotent
            try:
                self.driver.destroy(hosted.ctx)
            finally:
                with self._lock:
                    self._hosted.pop(sandbox_id, None)
                if hosted.copy_in is not None:
                    shutil.rmtree(hosted.copy_in, ignore_errors=True)

        events = self._take_events(sandbox_id)
        reply = self._reply(None, remove)
        return dataclasses.replace(reply, events=events)

    @ray.method(concurrency_group="work")
    def reap(self) -> Reply:
        return self._reply(None, self._reap)

    # -- backstop -------------------------------------------------------------------------
    def _backstop(self) -> None:
        while not self._stop.wait(BACKSTOP_TICK_S):
            try:
                self.sweep()
            except Exception:
                logger.exception("backstop sweep failed")

    def sweep(self) -> list[str]:
        """Destroy sandboxes nobody can still want: their slot's placement group is gone
        (its creator died) or their total timeout passed ``BACKSTOP_GRACE_S`` ago."""
        now = time.monotonic()
        with self._lock:
            hosted = list(self._hosted.values())
        doomed: list[tuple[str, str]] = []
        for h in hosted:
            if now > h.deadline:
                doomed.append((h.ctx.id, "its total timeout passed and nobody destroyed it"))
            elif h.slot is not None and not _slot_alive(h.slot):
                doomed.append((h.ctx.id, "its slot was released: its caller is gone"))
        for sandbox_id, why in doomed:
            logger.warning("destroying abandoned sandbox %s: %s", sandbox_id, why)
            reply = self._destroy(sandbox_id)
            if reply.error is not None:
                logger.error("destroying %s failed: %s", sandbox_id, reply.error.message)
        return [sid for sid, _ in doomed]

    def stop(self) -> None:
        self._stop.set()


def _slot_alive(slot: Any) -> bool:
    """False once the placement group holding the sandbox's slot is removed."""
    try:
        table = ray.util.placement_group_table(slot)
    except Exception:
        return True  # the GCS did not answer: no verdict, keep the sandbox
    return bool(table) and table.get("state") != "REMOVED"

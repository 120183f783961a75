"""Resource exhaustion of container sandboxes: OOM kills and full workspaces, turned into events
on the bus and an ephemeral cleanup that leaves nothing behind.

Push, not poll. ``SandboxManager`` holds the engine's event stream
(``docker events --filter event=oom``, through the SDK) open on one thread and
hands every OOM kill to ``ResourceExhaustionHandler.on_oom_kill`` as it happens:
no ``docker stats`` loop, no latency of a polling interval, no cost while
nothing goes wrong. A stream that ends unexpectedly (engine restart, socket
cut) is reopened from the last event seen (``since``), at most ``max_retries``
times in a row with exponential back-off; then the watcher logs an error and
stops, and the drain detector's cgroup counters remain as the slower net.

Who records what. The handler emits ``sandbox:oom`` / ``sandbox:disk_quota``,
stops and removes the container and its host directory, then emits
``sandbox:cleanup_complete``. It never writes a violation row: that stays with
the drain detector's ``enforce_quota`` (rule ``kernel``, idempotent per
sandbox), which sees the OOM in the driver's metrics (``oom_kills``). Before
anything is torn down, ``on_oom_kill`` tells the engine adapter
(``ContainerOps.note_oom``), so the driver keeps reporting the kill after the
container is gone: whichever of the run's final check and the handler comes
first, each OOM'd sandbox ends with exactly one ``MEMORY_EXCEEDED`` row.

Event names are the bus's constants; subscribe with ``bus.on(SandboxEvents.OOM,
listener)`` or ``handler.on(...)`` (removed again by ``SandboxManager.shutdown``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from devs_sandbox.base import Emit
from devs_sandbox.errors import DevsSandboxError, InvalidSandboxIdError
from devs_sandbox.events import EventBus, Listener, SandboxEvents
from devs_sandbox.models import utc_now_iso, validate_sandbox_id

if TYPE_CHECKING:
    from docker import DockerClient

logger = logging.getLogger(__name__)

HOST_DIR_PREFIX: Final = "devs-sandbox-"
MAX_RETRIES: Final = 3  # consecutive failed (re)connections before the watcher gives up
BACKOFF_BASE_S: Final = 0.5  # 0.5, 1, 2 s: an engine restart takes a few seconds
HEALTHY_AFTER_S: Final = 30.0  # a stream that stayed up this long resets the retry count
JOIN_TIMEOUT_S: Final = 5.0  # closing the stream unblocks the thread at once; bound it anyway
SEEN_EVENTS: Final = 1024  # (id, timeNano) remembered to drop events replayed after a reconnect
MANAGED_LABEL: Final = "devs.managed=true"

State = Literal["idle", "watching", "retrying", "failed", "stopped"]


class ContainerOps(Protocol):
    """What the handler needs of the engine; the Docker driver implements it."""

    def note_oom(self, container_id: str) -> None:
        """Record the kill with whoever reports the sandbox's metrics, before teardown."""
        ...

    def sandbox_id_of(self, container_id: str) -> str | None: ...

    def is_container_running(self, container_id: str) -> bool: ...

    def stop_container(self, container_id: str) -> None:
        """SIGKILL every process of the container (it stays until removed)."""
        ...

    def remove_container(self, container_id: str) -> None:
        """``docker rm -f``; a container that is already gone is not an error."""
        ...


class EventStream(Protocol):
    """A blocking iterator of engine events that another thread may ``close``."""

    def __iter__(self) -> Iterator[Mapping[str, Any]]: ...

    def close(self) -> None: ...


class EventSource(Protocol):
    """Opens an event stream, replaying from ``since`` (engine time, "sec.nanosec")."""

    def open(self, since: str | None) -> EventStream: ...


# -- the handler -------------------------------------------------------------------------
class ResourceExhaustionHandler:
    """Turns an exhausted container into events and an ephemeral cleanup."""

    OOM: Final = SandboxEvents.OOM
    DISK_QUOTA: Final = SandboxEvents.DISK_QUOTA
    CLEANUP_COMPLETE: Final = SandboxEvents.CLEANUP_COMPLETE

    def __init__(
        self,
        engine: ContainerOps,
        *,
        bus: EventBus | None = None,
        emit: Emit | None = None,
        temp_root: Path | None = None,
    ) -> None:
        """Events go to ``emit`` if given, else to ``bus``; ``on`` needs the bus."""
        self.engine = engine
        self.bus = bus
        self._emit_fn: Emit | None = emit if emit is not None else (bus.emit if bus else None)
        self.temp_root = temp_root or Path(tempfile.gettempdir())
        self._unsubscribes: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    # -- subscription ----------------------------------------------------------------
    def on(self, event: str, listener: Listener) -> Callable[[], None]:
        """Subscribe on the bus; ``remove_all_listeners`` (and the manager's shutdown) undo it."""
        if self.bus is None:
            raise RuntimeError("this handler has no bus; subscribe where its events are emitted")
        unsubscribe = self.bus.on(event, listener)
        with self._lock:
            self._unsubscribes.append(unsubscribe)
        return unsubscribe

    def remove_all_listeners(self) -> None:
        with self._lock:
            pending, self._unsubscribes = self._unsubscribes, []
        for unsubscribe in pending:
            unsubscribe()

    def listener_count(self) -> int:
        with self._lock:
            return len(self._unsubscribes)

    def _emit(self, event: str, payload: dict[str, Any]) -> None:
        if self._emit_fn is None:
            return
        try:
            self._emit_fn(event, payload)
        except Exception:  # emitting must not stop a cleanup (the bus already guards listeners)
            logger.exception("emitting %s failed", event)

    # -- reactions ----------------------------------------------------------------------
    # REQ: 8_RISKS-REQ-123
    def on_oom_kill(self, container_id: str) -> None:
        """The kernel OOM-killed a process of the container: report, stop, clean up, report."""
        sandbox_id = self._sandbox_id(container_id)
        try:
            self.engine.note_oom(container_id)
        except Exception:
            logger.exception("recording the OOM kill of %s failed", container_id[:12])
        self._emit(
            self.OOM,
            {"container_id": container_id, "sandbox_id": sandbox_id, "timestamp": utc_now_iso()},
        )
        try:
            if self.engine.is_container_running(container_id):
                self.engine.stop_container(container_id)
        except DevsSandboxError as exc:
            logger.warning("stopping OOM-killed container %s failed: %s", container_id[:12], exc)
        self._cleanup_and_report(container_id, sandbox_id, "oom")

    def on_disk_quota_exceeded(self, container_id: str) -> None:
        """The workspace filled up: report, clean up, report."""
        sandbox_id = self._sandbox_id(container_id)
        self._emit(
            self.DISK_QUOTA,
            {"container_id": container_id, "sandbox_id": sandbox_id, "timestamp": utc_now_iso()},
        )
        self._cleanup_and_report(container_id, sandbox_id, "disk_quota")

    def _cleanup_and_report(self, container_id: str, sandbox_id: str | None, reason: str) -> None:
        removed = self.cleanup_ephemeral_artifacts(container_id, sandbox_id=sandbox_id)
        self._emit(
            self.CLEANUP_COMPLETE,
            {
                "container_id": container_id,
                "sandbox_id": sandbox_id,
                "cleaned_at": utc_now_iso(),
                "reason": reason,
                "removed": removed,
            },
        )

    # REQ: 8_RISKS-REQ-123
    def cleanup_ephemeral_artifacts(
        self, container_id: str, *, sandbox_id: str | None = None
    ) -> bool:
        """``docker rm -f`` the container and delete ``<tmp>/devs-sandbox-<id>``; True when both
        are gone. Idempotent: whatever is already gone counts as cleaned."""
        if sandbox_id is None:
            sandbox_id = self._sandbox_id(container_id)
        clean = True
        try:
            self.engine.remove_container(container_id)
        except DevsSandboxError as exc:
            logger.error("removing container %s failed: %s", container_id[:12], exc)  # noqa: TRY400 - one line, the cause is in the message
            clean = False
        host_dir = self.host_dir(sandbox_id)
        if host_dir is not None and (host_dir.exists() or host_dir.is_symlink()):
            if host_dir.is_symlink():
                host_dir.unlink()
            else:
                shutil.rmtree(host_dir, ignore_errors=True)
            if host_dir.exists():
                logger.error("could not remove %s", host_dir)
                clean = False
        return clean

    def host_dir(self, sandbox_id: str | None) -> Path | None:
        """``<tmp>/devs-sandbox-<id>``; None for a missing or malformed id (a label that could
        be anything must never become a path outside the temp root)."""
        if sandbox_id is None:
            return None
        try:
            validate_sandbox_id(sandbox_id)
        except InvalidSandboxIdError:
            logger.warning("ignoring malformed sandbox id label %r", sandbox_id)
            return None
        return self.temp_root / f"{HOST_DIR_PREFIX}{sandbox_id}"

    def _sandbox_id(self, container_id: str) -> str | None:
        try:
            return self.engine.sandbox_id_of(container_id)
        except DevsSandboxError as exc:
            logger.debug("no sandbox id for %s: %s", container_id[:12], exc)
            return None


# -- the engine's event stream -------------------------------------------------------------
class _ClientStream:
    """An SDK event stream plus the client it owns, closed together."""

    def __init__(self, stream: Any, client: DockerClient) -> None:
        self._stream = stream
        self._client = client

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self._stream)  # decode=True: one dict per event

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()
        with contextlib.suppress(Exception):
            self._client.close()


class DockerOomEvents:
    """``docker events --filter event=oom`` through the SDK, on a connection of its own (a
    stream holds its connection for as long as it lives)."""

    def __init__(
        self,
        *,
        labels: tuple[str, ...] = (MANAGED_LABEL,),
        base_url: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.labels = labels
        self.base_url = base_url
        self.timeout_s = timeout_s

    def open(self, since: str | None) -> EventStream:
        from devs_sandbox.engine import connect, engine_errors  # noqa: PLC0415 - optional SDK

        client = connect(self.timeout_s, self.base_url)
        filters: dict[str, Any] = {"type": "container", "event": "oom"}
        if self.labels:
            filters["label"] = list(self.labels)
        since_arg: Any = since  # the API takes "sec.nanosec"; the stubs only know int seconds
        try:
            with engine_errors("docker events"):
                stream = client.events(decode=True, filters=filters, since=since_arg)
        except BaseException:
            client.close()
            raise
        return _ClientStream(stream, client)


def _engine_time(event: Mapping[str, Any]) -> str | None:
    nano = event.get("timeNano")
    if isinstance(nano, int) and nano > 0:
        return f"{nano // 1_000_000_000}.{nano % 1_000_000_000:09d}"
    return None


def _container_id(event: Mapping[str, Any]) -> str | None:
    actor = event.get("Actor")
    cid = event.get("id") or (actor.get("ID") if isinstance(actor, Mapping) else None)
    return str(cid) if cid else None


# -- the manager -----------------------------------------------------------------------------
# REQ: 8_RISKS-REQ-123
class SandboxManager:
    """Watches the engine's OOM events on one thread and calls ``on_oom_kill`` for each."""

    def __init__(
        self,
        handler: ResourceExhaustionHandler,
        *,
        source: EventSource | None = None,
        max_retries: int = MAX_RETRIES,
        backoff_base_s: float = BACKOFF_BASE_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
        thread_name: str = "devs-oom-watcher",
    ) -> None:
        if max_retries < 0 or backoff_base_s < 0:
            raise ValueError("max_retries and backoff_base_s must be >= 0")
        self.handler = handler
        self.source: EventSource = source or DockerOomEvents()
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.healthy_after_s = healthy_after_s
        self.thread_name = thread_name
        self.state: State = "idle"
        self.connections = 0  # streams opened successfully
        self.retries = 0  # reconnection attempts made, in total
        self.last_error: str | None = None
        self.connected = threading.Event()  # set while a stream is open
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stream: EventStream | None = None
        self._seen: deque[tuple[str, int]] = deque(maxlen=SEEN_EVENTS)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start watching (idempotent while running)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self.state = "watching"
            now_ns = time.time_ns()  # replay from here: nothing between start and connect is lost
            since = f"{now_ns // 1_000_000_000}.{now_ns % 1_000_000_000:09d}"
            self._thread = threading.Thread(
                target=self._run, args=(since,), name=self.thread_name, daemon=True
            )
            self._thread.start()

    def shutdown(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop the watcher (closing its stream unblocks it), join it, remove listeners."""
        self._stop.set()
        with self._lock:
            stream, thread = self._stream, self._thread
        if stream is not None:
            stream.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error("OOM watcher did not stop within %.1f s", timeout_s)
        self.handler.remove_all_listeners()
        self.state = "stopped"

    def _run(self, since: str | None) -> None:
        failures = 0
        while True:  # every exit is a break on the stop flag, or giving up
            opened_at = time.monotonic()
            error: str = "stream ended"
            try:
                stream = self.source.open(since)
            except Exception as exc:
                error = f"cannot open the event stream: {exc}"
            else:
                with self._lock:
                    self._stream = stream
                if self._stop.is_set():  # shutdown raced the open: it could not close this one
                    stream.close()
                    break
                self.connections += 1
                self.state = "watching"
                self.connected.set()
                try:
                    for event in stream:
                        since = _engine_time(event) or since
                        failures = 0  # the engine delivered: the stream works
                        self._dispatch(event)
                except Exception as exc:
                    error = f"event stream failed: {exc}"
                finally:
                    self.connected.clear()
                    with self._lock:
                        self._stream = None
                    stream.close()
                if time.monotonic() - opened_at >= self.healthy_after_s:
                    failures = 0
            if self._stop.is_set():
                break
            failures += 1
            self.last_error = error
            if failures > self.max_retries:
                self.state = "failed"
                logger.error(
                    "OOM watcher gave up after %d retries (%s); OOM kills are still caught by "
                    "the drain detector's cgroup counters, at its polling interval",
                    self.max_retries,
                    error,
                )
                return
            delay = self.backoff_base_s * 2 ** (failures - 1)
            self.state = "retrying"
            self.retries += 1
            logger.warning(
                "OOM watcher: %s; reconnecting in %.2f s (retry %d of %d)",
                error,
                delay,
                failures,
                self.max_retries,
            )
            if self._stop.wait(delay):
                break
        self.state = "stopped"

    def _dispatch(self, event: Mapping[str, Any]) -> None:
        if event.get("status", event.get("Action")) != "oom":
            return
        cid = _container_id(event)
        if cid is None:
            return
        nano = event.get("timeNano")
        key = (cid, nano if isinstance(nano, int) else 0)
        if key in self._seen:  # replayed after a reconnect (``since`` has second granularity)
            return
        self._seen.append(key)
        try:
            self.handler.on_oom_kill(cid)
        except Exception:
            logger.exception("handling the OOM kill of %s failed", cid[:12])

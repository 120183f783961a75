"""Resource exhaustion on the real engine: OOM events pushed by the engine, the handler's
events and cleanup, one violation row per sandbox, and the watcher's own lifecycle."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

from devs_sandbox.errors import DiskQuotaExceededError, QuotaExceededError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.exhaustion import (
    DockerOomEvents,
    EventStream,
    ResourceExhaustionHandler,
    SandboxManager,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.models import SandboxContext
from tests.docker.conftest import LABELS, SESSION, dconfig, session_containers
from tests.helpers import background_pids
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.docker
MiB = 2**20
HOG = ["python3", "-c", "x = bytearray(256 * 1024 * 1024)"]
EXHAUSTION = {SandboxEvents.OOM, SandboxEvents.DISK_QUOTA, SandboxEvents.CLEANUP_COMPLETE}


def exhaustion_events(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in events if name in EXHAUSTION]


def test_an_oom_kill_is_pushed_reported_cleaned_up_and_recorded_once(
    manager: SandboxLifecycleManager,
    events: list[tuple[str, dict[str, Any]]],
    engine: Any,
) -> None:
    cfg = dconfig(quotas={"memory_bytes": 32 * MiB})
    with pytest.raises(QuotaExceededError) as err:
        manager.run_in_sandbox(HOG, cfg)
    outcome = err.value.outcome
    assert outcome is not None and outcome.exit_code == 137
    assert err.value.violation.type == "MEMORY_EXCEEDED"
    assert err.value.violation.rule == "kernel"
    sandbox_id = outcome.sandbox_id
    # The engine's event reaches the handler on the watcher thread: wait for its cleanup.
    assert wait_for(lambda: SandboxEvents.CLEANUP_COMPLETE in exhaustion_events(events), 30)
    names = exhaustion_events(events)
    assert names[:2] == [SandboxEvents.OOM, SandboxEvents.CLEANUP_COMPLETE]
    oom = next(p for n, p in events if n == SandboxEvents.OOM)
    done = next(p for n, p in events if n == SandboxEvents.CLEANUP_COMPLETE)
    assert oom["sandbox_id"] == sandbox_id and oom["container_id"] and oom["timestamp"]
    assert done["container_id"] == oom["container_id"] and done["cleaned_at"]
    assert done["reason"] == "oom" and done["removed"] is True
    assert not [c for c in session_containers(engine) if c["Id"] == oom["container_id"]]
    assert not (Path("/tmp") / f"devs-sandbox-{sandbox_id}").exists()
    assert manager.store is not None
    rows = manager.store.list(sandbox_id=sandbox_id)
    assert [r["violation_type"] for r in rows] == ["MEMORY_EXCEEDED"]


def test_an_oom_in_a_session_is_recorded_by_the_detector_once(
    manager: SandboxLifecycleManager, events: list[tuple[str, dict[str, Any]]]
) -> None:
    """No final check here: the detector's poll sees the OOM, even after the handler has
    removed the container, because the driver noted the kill first."""
    cfg = dconfig(quotas={"memory_bytes": 32 * MiB, "poll_interval_ms": 100})
    with manager.open_sandbox(cfg) as sb:
        sb.exec(HOG)
        assert wait_for(lambda: sb.violation is not None, 30)
        assert wait_for(lambda: SandboxEvents.CLEANUP_COMPLETE in exhaustion_events(events), 30)
        assert not sb.driver.is_running(sb.context)
        assert sb.violation is not None and sb.violation.type == "MEMORY_EXCEEDED"
    assert manager.store is not None
    assert manager.store.count() == 1


def test_a_full_workspace_is_routed_to_the_handler(
    driver: Any,
    manager: SandboxLifecycleManager,
    events: list[tuple[str, dict[str, Any]]],
    engine: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    removal = driver.removal
    removed: list[str] = []
    real_remove = removal.remove_container

    def remove_container(container_id: str) -> None:  # counts, then asks the real engine
        removed.append(container_id)
        real_remove(container_id)

    monkeypatch.setattr(removal, "remove_container", remove_container)
    cfg = dconfig(quotas={"disk_bytes": 2 * MiB})
    with pytest.raises(DiskQuotaExceededError) as err:
        manager.run_in_sandbox(["sh", "-c", "head -c 8000000 /dev/zero > big"], cfg)
    assert len(removed) == 1, f"the container was removed {len(removed)} times: {removed}"
    assert err.value.outcome is not None and err.value.outcome.exit_code == 137
    assert exhaustion_events(events) == [SandboxEvents.DISK_QUOTA, SandboxEvents.CLEANUP_COMPLETE]
    quota = next(p for n, p in events if n == SandboxEvents.DISK_QUOTA)
    assert quota["sandbox_id"] == err.value.outcome.sandbox_id
    assert not [c for c in session_containers(engine) if c["Id"] == quota["container_id"]]
    assert manager.store is not None
    assert [r["violation_type"] for r in manager.store.list()] == ["DISK_QUOTA_EXCEEDED"]


def test_a_fork_bomb_is_held_by_the_pids_limit_and_recorded(
    manager: SandboxLifecycleManager,
) -> None:
    cfg = dconfig(quotas={"process_count_limit": 24, "poll_interval_ms": 200})
    with pytest.raises(QuotaExceededError) as err:
        manager.run_in_sandbox(["sh", "-c", "while :; do sleep 100 & done"], cfg)
    assert err.value.violation.type == "PROCESS_COUNT_EXCEEDED"
    assert err.value.violation.rule == "kernel"
    assert manager.store is not None and manager.store.count() == 1


def test_cleanup_is_idempotent_and_tolerates_what_is_gone(
    driver: Any, sandbox: Callable[..., SandboxContext], engine: Any, bus: EventBus
) -> None:
    ctx = sandbox()
    cid = ctx.labels["container_id"]
    handler = ResourceExhaustionHandler(driver, bus=bus)
    assert handler.cleanup_ephemeral_artifacts(cid) is True
    assert not ctx.workspace.exists()
    assert not [c for c in session_containers(engine) if c["Id"] == cid]
    assert handler.cleanup_ephemeral_artifacts(cid) is True  # again: nothing left, still fine
    assert handler.cleanup_ephemeral_artifacts("0" * 64) is True  # never existed
    driver.destroy(ctx)  # the driver's destroy after the handler's cleanup is a no-op


def test_handler_on_a_container_the_driver_does_not_know(
    driver: Any, engine: Any, docker_image: str, bus: EventBus, tmp_path: Path
) -> None:
    """The handler works from the engine alone: labels name the sandbox and its host dir."""
    created = engine.api.create_container(
        docker_image,
        ["sleep", "300"],
        labels={**LABELS, "devs.managed": "true", "devs.sandbox.id": f"{SESSION}-x"},
        host_config=engine.api.create_host_config(init=True, network_mode="none"),
    )
    engine.api.start(created["Id"])
    host_dir = tmp_path / f"devs-sandbox-{SESSION}-x"
    host_dir.mkdir()
    seen: list[str] = []
    handler = ResourceExhaustionHandler(driver, bus=bus, temp_root=tmp_path)
    handler.on(SandboxEvents.OOM, lambda name, payload: seen.append(payload["sandbox_id"]))
    handler.on(SandboxEvents.CLEANUP_COMPLETE, lambda name, payload: seen.append(name))
    assert handler.listener_count() == 2
    handler.on_oom_kill(created["Id"])
    assert seen == [f"{SESSION}-x", SandboxEvents.CLEANUP_COMPLETE]
    assert not host_dir.exists()
    assert not [c for c in session_containers(engine) if c["Id"] == created["Id"]]
    handler.remove_all_listeners()
    assert handler.listener_count() == 0 and bus.listener_count(SandboxEvents.OOM) == 0


def test_malformed_sandbox_labels_never_become_paths(driver: Any, tmp_path: Path) -> None:
    handler = ResourceExhaustionHandler(driver, temp_root=tmp_path)
    assert handler.host_dir("../../etc") is None
    assert handler.host_dir(None) is None
    assert handler.host_dir("sb-1") == tmp_path / "devs-sandbox-sb-1"
    with pytest.raises(RuntimeError, match="no bus"):
        handler.on(SandboxEvents.OOM, lambda n, p: None)


# -- the watcher ---------------------------------------------------------------------------
class Recording:
    """Our EventSource seam around the real engine source: keeps the streams it opened so a
    test can cut one, as an engine restart would."""

    def __init__(self, inner: DockerOomEvents) -> None:
        self.inner = inner
        self.streams: list[EventStream] = []
        self.since: list[str | None] = []

    def open(self, since: str | None) -> EventStream:
        self.since.append(since)
        stream = self.inner.open(since)
        self.streams.append(stream)
        return stream


class Calls:
    """A ContainerOps that only counts (the engine is not touched by these watcher tests)."""

    def __init__(self) -> None:
        self.ooms: list[str] = []
        self.event = threading.Event()

    def note_oom(self, container_id: str) -> None:
        self.ooms.append(container_id)
        self.event.set()

    def sandbox_id_of(self, container_id: str) -> str | None:
        return None

    def is_container_running(self, container_id: str) -> bool:
        return False

    def stop_container(self, container_id: str) -> None:
        pass

    def remove_container(self, container_id: str) -> None:
        pass


def oom_once(engine: Any, image: str) -> str:
    """A real OOM kill in a throwaway container labelled for this session; its id."""
    created = engine.api.create_container(
        image,
        HOG,
        labels={**LABELS, "devs.managed": "true"},
        host_config=engine.api.create_host_config(
            mem_limit=32 * MiB, memswap_limit=32 * MiB, network_mode="none"
        ),
    )
    engine.api.start(created["Id"])
    engine.api.wait(created["Id"], timeout=60)
    engine.api.remove_container(created["Id"], force=True)
    return str(created["Id"])


@pytest.fixture
def watcher_threads() -> Iterator[None]:
    yield
    assert not [t for t in threading.enumerate() if t.name.startswith("devs-test-watcher")]


def test_the_watcher_restarts_after_its_stream_is_cut(
    engine: Any, docker_image: str, watcher_threads: None
) -> None:
    calls = Calls()
    source = Recording(DockerOomEvents(labels=(f"devs.test={SESSION}",)))
    manager = SandboxManager(
        ResourceExhaustionHandler(calls),
        source=source,
        backoff_base_s=0.05,
        thread_name="devs-test-watcher-1",
    )
    manager.start()
    manager.start()  # idempotent while running
    try:
        assert manager.connected.wait(30)
        source.streams[0].close()  # the engine "drops" the stream
        assert wait_for(lambda: manager.connections == 2 and manager.connected.is_set(), 30)
        assert manager.retries == 1 and source.since[1] is not None  # replays from the last seen
        cid = oom_once(engine, docker_image)
        assert calls.event.wait(30)
        assert calls.ooms == [cid]
        assert manager.state == "watching"
    finally:
        manager.shutdown()
    assert manager.state == "stopped" and not manager.running


def test_the_watcher_gives_up_after_three_retries(
    caplog: pytest.LogCaptureFixture, watcher_threads: None, tmp_path: Path
) -> None:
    unreachable = DockerOomEvents(base_url=f"unix://{tmp_path}/no-engine.sock", timeout_s=1)
    manager = SandboxManager(
        ResourceExhaustionHandler(Calls()),
        source=unreachable,
        backoff_base_s=0.01,
        thread_name="devs-test-watcher-2",
    )
    with caplog.at_level(logging.WARNING, logger="devs_sandbox.exhaustion"):
        manager.start()
        assert wait_for(lambda: not manager.running, 30)
    assert manager.state == "failed"
    assert manager.retries == 3 and manager.connections == 0
    assert "cannot open the event stream" in (manager.last_error or "")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "gave up after 3 retries" in errors[0].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3
    manager.shutdown()  # after giving up: still clean


def test_a_healthy_stream_resets_the_retry_budget(watcher_threads: None) -> None:
    source = Recording(DockerOomEvents(labels=(f"devs.test={SESSION}",)))
    manager = SandboxManager(
        ResourceExhaustionHandler(Calls()),
        source=source,
        backoff_base_s=0.01,
        healthy_after_s=0.0,  # every stream that opened counts as healthy
        max_retries=1,
        thread_name="devs-test-watcher-3",
    )
    manager.start()
    try:
        for n in range(1, 4):  # three cuts, with a budget of one retry
            assert wait_for(lambda n=n: manager.connections == n and manager.connected.is_set(), 30)
            source.streams[-1].close()
        assert wait_for(lambda: manager.connections == 4, 30)
        assert manager.state == "watching"
    finally:
        manager.shutdown()


def test_shutdown_leaves_no_thread_child_or_listener(bus: EventBus) -> None:
    handler = ResourceExhaustionHandler(Calls(), bus=bus)
    handler.on(SandboxEvents.OOM, lambda n, p: None)
    handler.on(SandboxEvents.CLEANUP_COMPLETE, lambda n, p: None)
    manager = SandboxManager(handler, thread_name="devs-test-watcher-4")
    manager.shutdown()  # before start: fine
    manager.start()
    assert manager.connected.wait(30)
    threads_during = [t for t in threading.enumerate() if t.name == "devs-test-watcher-4"]
    assert len(threads_during) == 1
    manager.shutdown()
    manager.shutdown()  # idempotent
    assert not [t for t in threading.enumerate() if t.name == "devs-test-watcher-4"]
    background = background_pids()
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in background]
    assert bus.listener_count(SandboxEvents.OOM) == 0
    assert bus.listener_count(SandboxEvents.CLEANUP_COMPLETE) == 0
    assert manager.state == "stopped"


def test_a_failing_handler_does_not_stop_the_watcher(
    engine: Any, docker_image: str, watcher_threads: None
) -> None:
    class Exploding(Calls):
        def note_oom(self, container_id: str) -> None:
            super().note_oom(container_id)
            raise RuntimeError("listener bug")

    calls = Exploding()
    seen: list[Mapping[str, Any]] = []

    def emit(name: str, payload: dict[str, Any]) -> None:
        seen.append(payload)
        raise RuntimeError("emit bug")

    manager = SandboxManager(
        ResourceExhaustionHandler(calls, emit=emit),
        source=DockerOomEvents(labels=(f"devs.test={SESSION}",)),
        thread_name="devs-test-watcher-5",
    )
    manager.start()
    try:
        assert manager.connected.wait(30)
        oom_once(engine, docker_image)
        assert calls.event.wait(30)
        assert wait_for(lambda: len(seen) >= 2, 10)  # oom and cleanup_complete, despite errors
        assert manager.running and manager.state == "watching"
    finally:
        manager.shutdown()


def test_driver_close_stops_its_watcher(docker_image: str) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    driver = DockerDriver(extra_labels=LABELS)
    ctx = driver.provision(dconfig())
    try:
        assert driver.oom_watcher is not None and driver.oom_watcher.running
    finally:
        driver.destroy(ctx)
        driver.close()
    assert not driver.oom_watcher.running
    assert not [t for t in threading.enumerate() if t.name == "devs-oom-watcher"]

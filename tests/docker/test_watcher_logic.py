"""The watcher's and the handler's own logic, driven through their seams (``EventSource``,
``ContainerOps``) with scripted implementations, like httpx's MockTransport: the paths
a real engine reaches only by accident (a stream that raises, a shutdown racing a
reconnect, a remove that fails). They need no engine, hence the ``unit`` marker; they
live here beside the engine tests of the same module, whose coverage they complete."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.errors import DriverError, DriverUnavailableError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.exhaustion import (
    DockerOomEvents,
    EventStream,
    ResourceExhaustionHandler,
    SandboxManager,
)
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.unit


class Ops:
    """A ContainerOps with switchable failures; records what the handler asked."""

    def __init__(self, *, running: bool = True, fail: frozenset[str] = frozenset()) -> None:
        self.running = running
        self.fail = fail
        self.calls: list[str] = []

    def _maybe_fail(self, what: str) -> None:
        self.calls.append(what)
        if what in self.fail:
            raise DriverUnavailableError(f"{what}: engine gone")

    def note_oom(self, container_id: str) -> None:
        self._maybe_fail("note_oom")

    def sandbox_id_of(self, container_id: str) -> str | None:
        self._maybe_fail("sandbox_id_of")
        return "sb-logic"

    def is_container_running(self, container_id: str) -> bool:
        self._maybe_fail("is_container_running")
        return self.running

    def stop_container(self, container_id: str) -> None:
        self._maybe_fail("stop_container")
        self.running = False

    def remove_container(self, container_id: str) -> None:
        self._maybe_fail("remove_container")


class Script:
    """A scripted EventStream: yields events, then ends, raises, or blocks until closed."""

    def __init__(self, events: list[Mapping[str, Any]], end: str = "block") -> None:
        self.events = events
        self.end = end
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        yield from self.events
        if self.end == "raise":
            raise ConnectionResetError("engine went away")
        if self.end == "block":
            self.closed.wait(30)

    def close(self) -> None:
        self.closed.set()


class Source:
    """Serves scripted streams in order; an Exception in the list fails that open."""

    def __init__(self, *streams: Script | Exception, gate: threading.Event | None = None) -> None:
        self.streams = list(streams)
        self.opened: list[str | None] = []
        self.gate = gate

    def open(self, since: str | None) -> EventStream:
        self.opened.append(since)
        if self.gate is not None:
            self.gate.wait(30)
        item = self.streams.pop(0) if self.streams else Script([])
        if isinstance(item, Exception):
            raise item
        return item


def oom(cid: str, nano: int | None = 1_700_000_000_123_456_789) -> dict[str, Any]:
    event: dict[str, Any] = {"status": "oom", "id": cid, "Type": "container", "Action": "oom"}
    if nano is not None:
        event["timeNano"] = nano
    return event


def run(manager: SandboxManager, until: Any) -> None:
    manager.start()
    try:
        assert wait_for(until, 10)
    finally:
        manager.shutdown()


# -- the handler ------------------------------------------------------------------------------
def test_oom_path_order_and_payloads(tmp_path: Path) -> None:
    ops = Ops()
    bus = EventBus()
    seen: list[tuple[str, dict[str, Any]]] = []
    bus.on(EventBus.WILDCARD, lambda n, p: seen.append((n, p)))
    (tmp_path / "devs-sandbox-sb-logic").mkdir()
    ResourceExhaustionHandler(ops, bus=bus, temp_root=tmp_path).on_oom_kill("c1")
    assert ops.calls == [
        "sandbox_id_of",
        "note_oom",
        "is_container_running",
        "stop_container",
        "remove_container",
    ]
    assert [n for n, _ in seen] == [SandboxEvents.OOM, SandboxEvents.CLEANUP_COMPLETE]
    assert seen[0][1]["sandbox_id"] == "sb-logic" and seen[1][1]["removed"] is True
    assert not (tmp_path / "devs-sandbox-sb-logic").exists()


def test_oom_path_carries_on_through_every_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ops = Ops(fail=frozenset({"sandbox_id_of", "note_oom", "stop_container", "remove_container"}))
    seen: list[str] = []
    handler = ResourceExhaustionHandler(ops, emit=lambda n, p: seen.append(n), temp_root=tmp_path)
    with caplog.at_level(logging.DEBUG, logger="devs_sandbox.exhaustion"):
        handler.on_oom_kill("c2")
    assert seen == [SandboxEvents.OOM, SandboxEvents.CLEANUP_COMPLETE]
    assert "remove_container" in ops.calls  # cleanup still attempted
    assert any("removing container" in r.getMessage() for r in caplog.records)


def test_a_stopped_container_is_not_stopped_again(tmp_path: Path) -> None:
    ops = Ops(running=False)
    ResourceExhaustionHandler(ops, temp_root=tmp_path).on_oom_kill("c3")  # no emit: silent
    assert "stop_container" not in ops.calls


def test_cleanup_removes_a_symlink_and_reports_what_stays(tmp_path: Path) -> None:
    handler = ResourceExhaustionHandler(Ops(), temp_root=tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "devs-sandbox-sb-logic").symlink_to(target)
    assert handler.cleanup_ephemeral_artifacts("c4") is True
    assert target.is_dir()  # the link went, never what it points to
    failing = ResourceExhaustionHandler(
        Ops(fail=frozenset({"remove_container"})), temp_root=tmp_path
    )
    assert failing.cleanup_ephemeral_artifacts("c4") is False


@pytest.mark.root
@pytest.mark.tmpfs
def test_cleanup_reports_a_host_dir_it_cannot_remove(tmp_path: Path) -> None:
    from devs_sandbox.isolation import mounts

    busy = tmp_path / "devs-sandbox-sb-logic"
    busy.mkdir()
    mounts.mount_tmpfs(busy, mounts.TmpfsOptions(1 << 20, 16, 0, 0))
    try:
        assert (
            ResourceExhaustionHandler(Ops(), temp_root=tmp_path).cleanup_ephemeral_artifacts("c5")
            is False
        )
    finally:
        mounts.unmount(busy)
        busy.rmdir()


def test_disk_quota_path(tmp_path: Path) -> None:
    seen: list[str] = []
    ops = Ops()
    ResourceExhaustionHandler(
        ops, emit=lambda n, p: seen.append(n), temp_root=tmp_path
    ).on_disk_quota_exceeded("c6")
    assert seen == [SandboxEvents.DISK_QUOTA, SandboxEvents.CLEANUP_COMPLETE]
    assert "stop_container" not in ops.calls and "remove_container" in ops.calls


# -- the manager ------------------------------------------------------------------------------
def test_events_are_filtered_and_deduplicated() -> None:
    ops = Ops(running=False)
    events = [
        oom("a"),
        oom("a"),  # replayed after a reconnect: same id and time
        {"status": "die", "id": "b"},  # not an OOM
        {"status": "oom", "Actor": {"ID": "c"}},  # id only in Actor, no time
        {"status": "oom"},  # no container at all
        oom("a", nano=1_700_000_001_000_000_000),  # a second kill in the same container
    ]
    manager = SandboxManager(ResourceExhaustionHandler(ops), source=Source(Script(events)))
    run(manager, lambda: ops.calls.count("note_oom") == 3)
    assert ops.calls.count("note_oom") == 3


def test_a_raising_stream_and_a_raising_handler_are_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Boom(ResourceExhaustionHandler):
        def on_oom_kill(self, container_id: str) -> None:
            raise RuntimeError("handler bug")

    source = Source(Script([oom("x")], end="raise"), Script([]))
    manager = SandboxManager(Boom(Ops()), source=source, backoff_base_s=0.01)
    with caplog.at_level(logging.WARNING, logger="devs_sandbox.exhaustion"):
        run(manager, lambda: manager.connections == 2)
    assert source.opened[1] == "1700000000.123456789"  # resumes from the last event's time
    messages = [r.getMessage() for r in caplog.records]
    assert any("handling the OOM kill" in m for m in messages)
    assert any("event stream failed: engine went away" in m for m in messages)


def test_shutdown_during_back_off_returns_at_once() -> None:
    manager = SandboxManager(
        ResourceExhaustionHandler(Ops()),
        source=Source(DriverError("refused")),
        backoff_base_s=30.0,
    )
    manager.start()
    assert wait_for(lambda: manager.state == "retrying", 10)
    manager.shutdown(timeout_s=5)
    assert not manager.running and manager.state == "stopped"


def test_shutdown_racing_an_open_closes_the_new_stream() -> None:
    gate = threading.Event()
    stream = Script([])
    manager = SandboxManager(ResourceExhaustionHandler(Ops()), source=Source(stream, gate=gate))
    manager.start()
    stopper = threading.Thread(target=manager.shutdown)
    stopper.start()
    assert wait_for(manager._stop.is_set, 10)
    gate.set()  # the open completes after shutdown began
    stopper.join(10)
    assert stream.closed.is_set() and manager.connections == 0 and not manager.running


def test_a_wedged_handler_is_reported_by_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    class Wedged(ResourceExhaustionHandler):
        def on_oom_kill(self, container_id: str) -> None:
            release.wait(30)

    manager = SandboxManager(Wedged(Ops()), source=Source(Script([oom("w")])))
    manager.start()
    assert wait_for(lambda: manager.connections == 1, 10)
    with caplog.at_level(logging.ERROR, logger="devs_sandbox.exhaustion"):
        manager.shutdown(timeout_s=0.2)
    assert any("did not stop" in r.getMessage() for r in caplog.records)
    release.set()
    assert wait_for(lambda: not manager.running, 10)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        SandboxManager(ResourceExhaustionHandler(Ops()), max_retries=-1)
    default = SandboxManager(ResourceExhaustionHandler(Ops()))
    assert isinstance(default.source, DockerOomEvents) and default.state == "idle"


@pytest.mark.docker
def test_a_request_the_engine_refuses_ends_the_stream_at_once() -> None:
    """The engine answers a bad ``since`` with an error body, not events: the stream ends,
    which the manager treats like any other cut (retry, back off, give up)."""
    rejected = DockerOomEvents(labels=()).open("not-a-time")
    assert list(rejected) == []
    rejected.close()
    unreachable = DockerOomEvents(base_url="unix:///nonexistent/docker.sock", timeout_s=1)
    with pytest.raises(DriverUnavailableError):
        unreachable.open(None)

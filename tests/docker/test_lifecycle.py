"""The Docker driver under the lifecycle: runs, timeouts, preflight, metrics for the drain
detector, the warm pool, and shutdown releasing the driver's own resources."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.base import ExecRequest
from devs_sandbox.errors import (
    ImageUnavailableError,
    QuotaExceededError,
    SandboxTimeoutError,
    UnsupportedRuntimeError,
)
from devs_sandbox.events import EventBus
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.models import SandboxContext
from tests.docker.conftest import LABELS, dconfig, session_containers
from tests.helpers import manager as new_manager

pytestmark = pytest.mark.docker
MiB = 2**20


def test_run_reports_everything(manager: SandboxLifecycleManager, engine: Any) -> None:
    out = manager.run_in_sandbox(["python3", "-c", "print(6 * 7)"], dconfig())
    assert out.exit_code == 0 and out.result.stdout.text == "42\n"
    assert out.driver == "docker"
    assert {"cgroup-v1", "cgroup-v2"} & set(out.isolation)
    r = out.result.resources
    assert r.cpu_time_s is not None and r.peak_memory_bytes and r.peak_processes >= 1
    assert not [c for c in session_containers(engine) if out.sandbox_id in c["Names"][0]]


def test_preflight_then_task(manager: SandboxLifecycleManager) -> None:
    cfg = dconfig(preflight_commands=("echo prepared > state",))
    out = manager.run_in_sandbox(["cat", "state"], cfg)  # the task runs through docker exec
    assert out.result.stdout.text == "prepared\n"
    assert out.preflight[0].exit_code == 0


def test_total_timeout_kills_and_removes(manager: SandboxLifecycleManager, engine: Any) -> None:
    with pytest.raises(SandboxTimeoutError) as err:
        manager.run_in_sandbox(["sleep", "60"], dconfig(timeout_ms=1500))
    outcome = err.value.outcome
    assert outcome is not None and outcome.exit_code == 124 and outcome.timed_out
    assert not [c for c in session_containers(engine) if outcome.sandbox_id in c["Names"][0]]


def test_runtime_gate_with_the_default_image(manager: SandboxLifecycleManager) -> None:
    """The default image declares python only: a Go build is refused before anything runs."""
    with pytest.raises(UnsupportedRuntimeError) as err:
        manager.run_in_sandbox(["go", "build"], dconfig())
    assert err.value.runtime == "go" and err.value.suggested_driver == "process"
    with manager.open_sandbox(dconfig()) as sb, pytest.raises(UnsupportedRuntimeError):
        sb.exec("cargo build")


def test_metrics_feed_the_drain_detector(
    driver: Any, sandbox: Callable[..., SandboxContext]
) -> None:
    ctx = sandbox(quotas={"file_count_limit": 200, "disk_bytes": 8 * MiB})
    script = (
        "mkdir -p a/b/c/d; head -c 300000 /dev/zero > a/b/big; touch f1 f2; "
        "sleep 30 & sleep 30 & echo started"
    )
    assert driver.exec(ctx, ExecRequest.of(["sh", "-c", script])).stdout.text == "started\n"
    m = driver.get_metrics(ctx)
    assert m.running and m.process_count is not None and m.process_count >= 2
    assert m.file_count == 7  # a, b, c, d, big, f1, f2 (the tmpfs root is not counted)
    assert m.directory_depth == 4 and m.largest_file_bytes == 300_000
    assert m.memory_bytes and m.peak_memory_bytes and m.cpu_time_s is not None
    assert m.inodes_free is not None and m.inodes_free <= 201 - 7
    assert m.disk_free_bytes is not None and m.disk_free_bytes < 8 * MiB
    assert m.pids_limit_hits == 0 and m.oom_kills == 0
    driver.force_stop(ctx)
    after = driver.get_metrics(ctx)
    assert not after.running and after.process_count == 0 and after.file_count is None


def test_a_file_bomb_is_stopped_by_the_inode_limit(manager: SandboxLifecycleManager) -> None:
    cfg = dconfig(quotas={"file_count_limit": 50, "poll_interval_ms": 200})
    with pytest.raises(QuotaExceededError) as err:
        manager.run_in_sandbox(["sh", "-c", "i=0; while :; do i=$((i+1)); : > f$i; done"], cfg)
    assert err.value.violation.type == "FILE_COUNT_EXCEEDED"


def test_warm_pool_hands_out_prestarted_containers(
    docker_image: str, engine: Any, tmp_path: Path
) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    bus = EventBus()
    driver = DockerDriver(emit=bus.emit, extra_labels=LABELS)
    manager = new_manager(driver, db=tmp_path / "v.db", bus=bus)
    cfg = dconfig(docker={"warm_pool_size": 1})
    try:
        first = manager.run_in_sandbox(["echo", "one"], cfg)
        assert first.result.stdout.text == "one\n"
        from tests.integration.helpers import wait_for

        assert wait_for(lambda: len(driver.pool.ids()) == 1, 60)
        (pooled,) = driver.pool.ids()
        second = manager.run_in_sandbox(["sh", "-c", "echo two; cat /proc/1/cmdline"], cfg)
        assert second.sandbox_id == pooled and second.result.stdout.text.startswith("two\n")
        fixed = manager.run_in_sandbox(
            ["true"], dconfig(docker={"warm_pool_size": 1}, sandbox_id="devs-test-fixed-1")
        )
        assert fixed.sandbox_id == "devs-test-fixed-1"  # a fixed id never takes a pooled one
    finally:
        manager.shutdown()  # closes the driver: drains the pool and background removals
    assert not session_containers(engine)
    assert not [t for t in threading.enumerate() if t.name.startswith("devs-docker-")]


def test_shutdown_closes_the_driver(docker_image: str) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    driver = DockerDriver(extra_labels=LABELS)
    manager = new_manager(driver)
    manager.run_in_sandbox(["true"], dconfig())
    assert driver.oom_watcher is not None and driver.oom_watcher.running
    manager.shutdown()
    assert not driver.oom_watcher.running
    with pytest.raises(Exception, match="closed"):
        driver.provision(dconfig())


def test_driver_reports_where_its_image_came_from(driver: Any, docker_image: str) -> None:
    ctx = driver.provision(
        dconfig(image="devs-test-absent/never-built:1", docker={"pull_timeout_s": 5})
    )
    try:
        assert ctx.labels["image"] == docker_image
        assert ctx.labels["image_source"] == "rebuilt"
    finally:
        driver.destroy(ctx)
    with pytest.raises(ImageUnavailableError):
        driver.provision(
            dconfig(image="devs-test-absent/never-built:1", docker={"rebuild_default_image": False})
        )

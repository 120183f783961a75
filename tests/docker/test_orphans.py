"""Crash safety: containers whose owner died are found by their labels and reaped, on
demand (``devs-sandbox cleanup``) and on the next start; live owners' are never touched."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.drivers.process import ProcessDriver
from devs_sandbox.leases import LeaseRegistry
from devs_sandbox.models import SandboxContext
from tests.conftest import run_cli
from tests.docker.conftest import LABELS
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.docker


def managed(engine: Any) -> dict[str, dict[str, Any]]:
    """sandbox id -> container, for every devs-managed container on the engine."""
    found = engine.api.containers(all=True, filters={"label": "devs.managed=true"})
    return {c["Labels"].get("devs.sandbox.id", ""): c for c in found}


@pytest.fixture
def crashed(engine: Any, docker_image: str) -> Iterator[Callable[[], str]]:
    """``crashed()`` starts ``devs-sandbox run --driver docker`` and SIGKILLs it mid-run:
    no finally, no destroy. Returns the sandbox id it left behind."""
    left: list[str] = []

    def make() -> str:
        sandbox_id = f"devs-test-orphan-{uuid.uuid4().hex[:8]}"
        owner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devs_sandbox",
                "run",
                "--driver",
                "docker",
                "--sandbox-id",
                sandbox_id,
                "--",
                "sleep",
                "300",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        left.append(sandbox_id)
        assert wait_for(lambda: sandbox_id in managed(engine), 60)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        return sandbox_id

    yield make
    for sandbox_id in left:  # whatever a failed test did not reap
        container = managed(engine).get(sandbox_id)
        if container is not None:
            engine.api.remove_container(container["Id"], force=True)
        LeaseRegistry().remove(sandbox_id)
        host_dir = Path("/tmp") / f"devs-sandbox-{sandbox_id}"
        if host_dir.exists():
            import shutil

            shutil.rmtree(host_dir)


def test_an_orphan_is_reaped_by_cleanup_not_by_the_process_reaper(
    crashed: Callable[[], str], engine: Any
) -> None:
    sandbox_id = crashed()
    host_dir = Path("/tmp") / f"devs-sandbox-{sandbox_id}"
    assert host_dir.is_dir() and LeaseRegistry().read(sandbox_id) is not None
    assert sandbox_id not in ProcessDriver().reap_orphans()  # another driver's lease
    assert sandbox_id in managed(engine) and host_dir.is_dir()
    r = run_cli("cleanup", "--json")
    assert r.returncode == 0, r.stderr
    reaped = json.loads(r.stdout)["reaped"]
    # Any devs-sandbox start on this host reaps orphans; a concurrent test session may have
    # been first. Whoever did it, it is the docker driver's and it is gone.
    assert sandbox_id not in reaped.get("process", [])
    assert sandbox_id in reaped.get("docker", []) or sandbox_id not in managed(engine)
    assert sandbox_id not in managed(engine)
    assert not host_dir.exists() and LeaseRegistry().read(sandbox_id) is None


def test_an_orphan_without_its_lease_is_found_by_its_labels(
    crashed: Callable[[], str], engine: Any, driver: Any
) -> None:
    sandbox_id = crashed()
    LeaseRegistry().remove(sandbox_id)  # the lease directory was wiped
    reaped = driver.reap_orphans()
    assert sandbox_id in reaped or sandbox_id not in managed(engine)  # (or a concurrent reaper)
    assert sandbox_id not in managed(engine)
    assert not (Path("/tmp") / f"devs-sandbox-{sandbox_id}").exists()


def test_the_next_start_reaps_orphans(crashed: Callable[[], str], engine: Any) -> None:
    sandbox_id = crashed()
    r = run_cli("run", "--driver", "docker", "--", "true")
    assert r.returncode == 0, r.stderr
    assert sandbox_id not in managed(engine)


def test_a_live_owners_sandbox_is_never_reaped(
    sandbox: Callable[..., SandboxContext], engine: Any, docker_image: str
) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    ctx = sandbox()
    other = DockerDriver(extra_labels=LABELS, watch_oom=False)  # same live owner: this process
    try:
        assert ctx.id not in other.reap_orphans()
    finally:
        other.close()
    assert ctx.id in managed(engine)
    r = run_cli("cleanup", "--json")  # another process: we are alive, so hands off
    assert ctx.id not in json.dumps(json.loads(r.stdout))
    assert ctx.id in managed(engine)


def test_a_dead_owners_lease_without_container_is_cleared(driver: Any) -> None:
    from devs_sandbox.leases import Lease, Owner

    sandbox_id = f"devs-test-lease-{uuid.uuid4().hex[:8]}"
    host_dir = Path("/tmp") / f"devs-sandbox-{sandbox_id}"
    host_dir.mkdir()
    LeaseRegistry().write(Lease(sandbox_id, "docker", Owner(2**22 + 7, 1, ""), str(host_dir)))
    assert sandbox_id in driver.reap_orphans()
    assert not host_dir.exists() and LeaseRegistry().read(sandbox_id) is None

"""A node dies mid-run: the caller gets SandboxLostError (CLI: exit 125 naming the node),
never a hang; when a node starts again on that host, its host actor reaps what the dead
sandbox left (lease, cgroup, tmpfs workspace).

Its own cluster: the head offers no slots, so every sandbox goes to the one node that does,
and that node is the one removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from devs_sandbox import SandboxLifecycleConfig, SandboxLifecycleManager, override
from devs_sandbox.errors import SandboxLostError
from devs_sandbox.leases import LeaseRegistry
from devs_sandbox.store import ViolationStore
from tests.ray_cluster.conftest import SLOTS, start_cluster, stop_cluster, wait_for

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.cgroups,
    pytest.mark.tmpfs,
]


def _leftovers(sandbox_id: str) -> list[str]:
    """What of ``sandbox_id`` exists on this host: its lease, cgroups, mount, workspace."""
    found: list[str] = []
    if LeaseRegistry().path_for(sandbox_id).exists():
        found.append("lease")
    for cg in Path("/sys/fs/cgroup").glob(f"**/devs-sandbox/{sandbox_id}"):
        found.append(f"cgroup {cg}")
    if f"/devs-sandbox-{sandbox_id} " in Path("/proc/self/mountinfo").read_text():
        found.append("mount")
    if any(Path("/tmp").glob(f"devs-sandbox-{sandbox_id}")):
        found.append("workspace")
    return found


def test_a_removed_node_turns_into_sandbox_lost_and_its_leftovers_are_reaped(
    tmp_path: Path,
) -> None:
    rc = start_cluster({}, {SLOTS: 4})
    try:
        doomed = rc.node_ids[1]
        # Two runs on the doomed node: one through the CLI, one through the Python API.
        cli = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devs_sandbox",
                "run",
                "--driver",
                "ray",
                "--ray-address",
                rc.address,
                "--json",
                "--db",
                str(tmp_path / "cli.db"),
                "--",
                "sleep",
                "300",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        manager = SandboxLifecycleManager(store=ViolationStore(tmp_path / "api.db"))
        cfg = override(
            SandboxLifecycleConfig(), driver="ray", ray={"address": rc.address}, timeout_ms=300_000
        )
        api_error: list[BaseException] = []

        def api_run() -> None:
            try:
                manager.run_in_sandbox(["sleep", "300"], cfg)
            except BaseException as exc:
                api_error.append(exc)

        api = threading.Thread(target=api_run)
        api.start()

        # Both sandboxes live on the doomed node: their leases name its host actor's process.
        def both_running() -> list[tuple[str, int]] | None:
            leases = [(sid, lease) for sid, lease in LeaseRegistry().all() if lease is not None]
            mine = [
                (sid, lease.owner.pid)
                for sid, lease in leases
                if _is_worker_of(lease.owner.pid, rc.handles[doomed])
            ]
            return mine if len(mine) == 2 else None

        sandboxes = wait_for(both_running, what="two sandboxes on the doomed node")
        actor_pid = sandboxes[0][1]

        # The machine goes away: its raylet and, with it, every process on it at once (a
        # dying worker left alone would otherwise get a few seconds to tidy up).
        rc.remove(doomed)
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor_pid, signal.SIGKILL)  # the host actor our cluster started

        out, err = cli.communicate(timeout=120)  # a hang would end the test here
        api.join(timeout=120)
        assert not api.is_alive(), "the API run hung after its node died"
        manager.shutdown()

        assert cli.returncode == 125, (out, err)
        assert out.startswith("{"), (out[:800], err[-800:])
        payload: dict[str, Any] = json.loads(out)
        assert payload["exit_code"] == 125 and payload["node"] == doomed
        assert doomed in err and "lost" in err
        assert len(api_error) == 1 and isinstance(api_error[0], SandboxLostError), api_error
        lost = api_error[0]
        assert lost.node == doomed and lost.reason

        # The node's host actor is gone; what its sandboxes left stays until a reaper runs.
        wait_for(lambda: not psutil.pid_exists(actor_pid), what="the host actor to exit")
        ids = [sid for sid, _ in sandboxes]
        left_before = {sid: _leftovers(sid) for sid in ids}
        if not all("lease" in left for left in left_before.values()):
            pytest.skip("another devs-sandbox process on this host reaped them first")

        # A replacement node on the same host: its host actor reaps them when it starts.
        from devs_sandbox.drivers.ray.driver import RayDriver

        replacement = rc.add(**{SLOTS: 4})
        driver = RayDriver()
        try:
            infos = {i.node_id: i for i in driver.nodes(cfg)}
        finally:
            driver.close()
        assert set(infos) == {replacement}
        for sid in ids:
            assert _leftovers(sid) == [], _leftovers(sid)
        if not set(ids) <= set(infos[replacement].reaped_at_start):
            # Every devs-sandbox process on this host reaps dead owners' sandboxes when it
            # starts: on a host shared with other test sessions one may come first (on CI's
            # own machine nothing else runs, and this asserts the replacement did it).
            pytest.skip("another devs-sandbox process on this host reaped them first")
    finally:
        stop_cluster(rc)


def _is_worker_of(pid: int, node: Any) -> bool:
    """Whether ``pid`` is a worker process of the raylet of ``node`` (a cluster node)."""
    raylet_pids = {
        p.process.pid
        for p in node.all_processes.get("raylet", [])  # the node's raylet(s)
    }
    try:
        parent = psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return False
    return parent in raylet_pids

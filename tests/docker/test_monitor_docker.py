"""run_shell_monitored through the Docker driver: the container's whole cgroup is watched."""

from __future__ import annotations

import pytest

from devs_sandbox.errors import ResourceLimitExceededError
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.tools.shell import MonitoredShellOptions, run_shell_monitored_sync
from tests.docker.conftest import dconfig

pytestmark = pytest.mark.docker
MiB = 1 << 20
HOG = "python3 -c \"import time; x = b'x' * (200 << 20); time.sleep(60)\""


def test_a_double_forked_hog_in_a_container_is_killed(manager: SandboxLifecycleManager) -> None:
    """The grandchild is re-parented to the container's init, out of the exec's ppid tree."""
    opts = MonitoredShellOptions(rss_limit_bytes=64 * MiB, poll_interval_ms=100, timeout_s=60)
    with pytest.raises(ResourceLimitExceededError) as err:
        run_shell_monitored_sync(
            f"({HOG} &); sleep 30",
            opts,
            manager=manager,
            config=dconfig(quotas={"memory_bytes": 512 * MiB}),
        )
    assert err.value.reason == "rss"

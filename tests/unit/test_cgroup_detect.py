"""Which cgroup version hosts sandboxes, decided from /proc/self/mountinfo (pure parsing).

The kernel side of both versions is exercised for real by the integration tests on a
host that has it (v1 here; the cgroup_v2 test runs where v2 offers the controllers).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devs_sandbox.isolation.cgroups import _parse_mountinfo, detect

pytestmark = pytest.mark.unit

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw
"""


def test_parse_finds_v1_controllers_and_the_unified_mount() -> None:
    unified, v1 = _parse_mountinfo(HYBRID.format(unified="/sys/fs/cgroup/unified"))
    assert unified == Path("/sys/fs/cgroup/unified")
    assert v1 == {
        "cpu": Path("/sys/fs/cgroup/cpu"),
        "cpuacct": Path("/sys/fs/cgroup/cpuacct"),
        "memory": Path("/sys/fs/cgroup/memory"),
        "pids": Path("/sys/fs/cgroup/pids"),
    }


def test_hybrid_host_without_v2_controllers_uses_v1(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("hugetlb\n")
    support = detect(HYBRID.format(unified=tmp_path), require_writable=False)
    assert support.version == 1
    assert "memory" in support.mounts and "pids" in support.mounts


def test_v2_with_memory_and_pids_wins(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma\n")
    only_v2 = f"30 23 0:26 / {tmp_path} rw - cgroup2 cgroup2 rw,nsdelegate\n"
    support = detect(only_v2, require_writable=False)
    assert support.version == 2
    assert support.controllers == ("memory", "pids", "cpu")


def test_nothing_usable_says_why(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("")
    support = detect(f"30 23 0:26 / {tmp_path} rw - cgroup2 cgroup2 rw\n", require_writable=False)
    assert support.version is None and "lacks the memory/pids" in support.reason
    none = detect("22 1 0:5 / /proc rw - proc proc rw\n")
    assert none.version is None and "no cgroup filesystem" in none.reason


def test_mount_points_with_spaces_are_unescaped() -> None:
    unified, _ = _parse_mountinfo("41 31 0:38 / /weird\\040path rw - cgroup2 cgroup2 rw\n")
    assert unified == Path("/weird path")

"""The capability gate of tests/conftest.py, for real, in a nested pytest on this host.

A test marked with a host feature skips with its reason where the host lacks it, and
fails instead under DEVS_SANDBOX_REQUIRE_ALL=1 (CI), so a CI host that lost a layer
cannot pass by skipping its security tests. The host lacks the feature for real, not
through a fake: bubblewrap through a PATH without it (a fresh Debian without the
package), CAP_SYS_ADMIN through setpriv (root in a default ``docker run``, where
mount(2) refuses a tmpfs although euid is 0).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# Each carries exactly one capability marker.
NEEDS_BWRAP = (
    "tests/integration/test_process_driver.py::"
    "test_timeout_kills_every_process_including_setsid_grandchildren[pidns-only]"
)
NEEDS_TMPFS = "tests/integration/test_process_driver.py::test_workspace_tmpfs_holds_the_disk_quota"


def nested(
    nodeid: str, *, require_all: bool, path: str | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DEVS_SANDBOX_REQUIRE_ALL"}
    if require_all:
        env["DEVS_SANDBOX_REQUIRE_ALL"] = "1"
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [*prefix, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsf", nodeid],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("require_all", [False, True], ids=["skips", "require-all-fails"])
def test_a_host_without_bubblewrap(tmp_path: Path, require_all: bool) -> None:
    r = nested(NEEDS_BWRAP, require_all=require_all, path=str(tmp_path))
    out = r.stdout + r.stderr
    reason = "bwrap not found on PATH"
    if require_all:
        assert r.returncode == 1, out
        assert "DEVS_SANDBOX_REQUIRE_ALL=1 but bwrap unavailable" in out and reason in out, out
    else:
        assert r.returncode == 0 and "1 skipped" in out and reason in out, out


@pytest.mark.root
@pytest.mark.tmpfs
@pytest.mark.parametrize("require_all", [False, True], ids=["skips", "require-all-fails"])
def test_root_without_cap_sys_admin_cannot_mount_a_tmpfs(require_all: bool) -> None:
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "setpriv (util-linux) is in every Debian"
    drop = (setpriv, "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--")
    r = nested(NEEDS_TMPFS, require_all=require_all, prefix=drop)
    out = r.stdout + r.stderr
    reason = "Operation not permitted"  # mount(2) refused the tmpfs
    if require_all:
        assert r.returncode == 1, out
        assert "DEVS_SANDBOX_REQUIRE_ALL=1 but tmpfs unavailable" in out and reason in out, out
    else:
        assert r.returncode == 0 and "1 skipped" in out and reason in out, out

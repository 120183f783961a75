"""Shared fixtures: capability probes, an isolated store, and a session-end leak check.

Tests that need a host feature carry a marker (cgroups, bwrap, tmpfs, docker, root).
Where the host lacks the feature they skip with the reason; with
DEVS_SANDBOX_REQUIRE_ALL=1 (set by CI, whose host has them all) such a skip
becomes a failure, so a broken CI host cannot silently skip the security tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="devs-test-session."))
# Every CLI subprocess and every default manager of the test run writes here.
os.environ["DEVS_SANDBOX_DB"] = str(_SESSION_DIR / "violations.db")
os.environ.setdefault("XDG_DATA_HOME", str(_SESSION_DIR / "xdg"))
# Hermetic configuration: neither this machine's nor its user's devs-sandbox config applies.
os.environ["XDG_CONFIG_HOME"] = str(_SESSION_DIR / "xdg-config")
os.environ["DEVS_SANDBOX_SYSTEM_CONFIG"] = str(_SESSION_DIR / "no-system-config.json")
os.environ.pop("DEVS_SANDBOX_CONFIG", None)
# CLI tests run the command in its own process; the local server's path is tested on its
# own (tests/integration/test_cli_server.py), which also stops the servers it starts.
os.environ["DEVS_SANDBOX_DAEMON"] = "0"
# The host probes' verdicts: probed afresh once per test run, shared by its subprocesses.
os.environ["DEVS_SANDBOX_PROBE_CACHE"] = str(_SESSION_DIR / "probe-cache")

REQUIRE_ALL = os.environ.get("DEVS_SANDBOX_REQUIRE_ALL") == "1"
ROOT = Path(__file__).resolve().parents[1]


def _capabilities() -> dict[str, str]:
    """Marker -> "" when the host has it, else the reason it does not."""
    from devs_sandbox.isolation import SANDBOX_UID_BASE, probe_host

    host = probe_host()
    caps: dict[str, str] = {}
    caps["root"] = "" if os.geteuid() == 0 else "needs root"
    caps["cgroups"] = "" if host.cgroup.available else f"no usable cgroup: {host.cgroup.reason}"
    caps["bwrap"] = (
        "" if host.bwrap_root.works else f"bubblewrap unusable: {host.bwrap_root.reason}"
    )
    ok, why = host.nsinit_for(host.euid if host.euid else SANDBOX_UID_BASE)
    caps["unshare"] = "" if ok else f"unshare(2) namespaces unusable: {why}"
    caps["tmpfs"] = _tmpfs_reason()
    caps["docker"] = _docker_reason()
    caps["ray"] = _ray_reason()
    caps["node"] = _node_reason()
    for shell in ("zsh", "fish"):  # shell completion is tested in each real shell
        caps[shell] = (
            "" if shutil.which(shell) else f"{shell} not installed (apt-get install {shell})"
        )
    caps["cgroup_v2"] = (
        ""
        if host.cgroup.version == 2
        else ("host runs sandboxes on cgroup v1 (v2 offers no memory/pids controllers here)")
    )
    return caps


def _tmpfs_reason() -> str:
    """Mount one: ``can_mount`` asks "root?", and root without CAP_SYS_ADMIN (a default
    ``docker run``) is refused by mount(2) itself."""
    from devs_sandbox.isolation.mounts import TmpfsOptions, can_mount, mount_tmpfs, unmount

    ok, why = can_mount()
    if not ok:
        return why
    target = Path(tempfile.mkdtemp(prefix="devs-test-tmpfs-probe."))
    try:
        mount_tmpfs(target, TmpfsOptions(1 << 20, 16, os.geteuid(), os.getegid()))
    except OSError as exc:
        target.rmdir()
        return f"mount(2) of a tmpfs refused: {os.strerror(exc.errno or 0)} (no CAP_SYS_ADMIN?)"
    unmount(target)
    target.rmdir()
    return ""


def _docker_reason() -> str:
    try:
        import docker
    except ImportError:
        return "docker SDK not installed"
    try:
        client = docker.from_env(timeout=5)
        client.ping()
        client.close()
    except Exception as exc:
        return f"no Docker engine: {exc}"
    return ""


def _ray_reason() -> str:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "Ray not installed (pip install -e '.[dev]')"
    return ""


def _node_reason() -> str:
    """The official TypeScript MCP clients: Node.js and tests/mcp_clients' pinned packages."""
    import shutil

    if shutil.which("node") is None:
        return "Node.js not installed (apt-get install nodejs npm)"
    if not (ROOT / "tests" / "mcp_clients" / "node_modules" / "@modelcontextprotocol").is_dir():
        return "the MCP clients are not installed: npm ci --prefix tests/mcp_clients"
    return ""


_CAPS: dict[str, str] = {}
# The markers that name something a host may lack: a test so marked skips with the reason.
_CAPABILITY_MARKERS = (
    "root",
    "cgroups",
    "bwrap",
    "unshare",
    "tmpfs",
    "docker",
    "cgroup_v2",
    "ray",
    "node",
    "zsh",
    "fish",
)
# Those whose absence on a REQUIRE_ALL host is a CI failure, not a skip: all but cgroup v2
# with its controllers, which our CI hosts (cgroup v1) do not have.
_REQUIRED_ON_CI = frozenset(_CAPABILITY_MARKERS) - {"cgroup_v2"}


def caps() -> dict[str, str]:
    if not _CAPS:
        _CAPS.update(_capabilities())
    return _CAPS


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in _CAPABILITY_MARKERS:
        if item.get_closest_marker(name) is None:
            continue
        reason = caps().get(name, "")
        if not reason:
            continue
        if REQUIRE_ALL and name in _REQUIRED_ON_CI:
            pytest.fail(f"DEVS_SANDBOX_REQUIRE_ALL=1 but {name} unavailable: {reason}")
        pytest.skip(reason)


# -- the long MCP call, in the background -----------------------------------------------
LONG_CALL_TEST = "test_a_call_longer_than_the_typescript_timeout_completes_on_progress"
LONG_CALL_MODULE = "tests.integration.test_mcp_clients"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the 90 s TypeScript-client call now when it is among the tests to run (and
    can run here), so its wait overlaps the rest of the suite; the test collects it."""
    if session.config.option.collectonly or caps().get("node"):
        return
    if any(item.name == LONG_CALL_TEST for item in session.items):
        clients = sys.modules[LONG_CALL_MODULE]  # collected, so imported
        clients.long_call = clients.start_long_call(
            Path(tempfile.mkdtemp(prefix="devs-test-long-call-"))
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session cut short (-x, ^C) does not leave the long call running."""
    clients = sys.modules.get(LONG_CALL_MODULE)
    if clients is not None and getattr(clients, "long_call", None) is not None:
        clients.long_call[1].stop()


# -- leak check -------------------------------------------------------------------------
def _ours() -> set[int]:
    try:
        import psutil

        return {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:
        return {os.getpid()}


def _foreign(sandbox_id: str) -> bool:
    """A sandbox owned by a live process outside this test session (another session on the
    same host): not ours to judge."""
    from devs_sandbox.leases import LeaseRegistry

    lease = LeaseRegistry().read(sandbox_id)
    if lease is None or not lease.owner.alive():
        return False
    return lease.owner.pid not in _ours()


def _docker_leftovers() -> set[str]:
    """Containers labelled devs.managed=true, except those of a live owner outside this
    session (found by their owner labels, so a lost lease file hides nothing)."""
    try:
        import docker
        from devs_sandbox.drivers.docker import owner_from_labels

        client = docker.from_env(timeout=10)
        try:
            found = client.api.containers(all=True, filters={"label": "devs.managed=true"})
        finally:
            client.close()
    except Exception:
        return set()
    out: set[str] = set()
    for c in found:
        labels = c.get("Labels") or {}
        owner = owner_from_labels(labels)
        if owner.alive() and owner.pid not in _ours():
            continue
        name = (c.get("Names") or ["?"])[0].lstrip("/")
        out.add(f"container {name} ({labels.get('devs.sandbox.id')})")
    return out


def _leftovers() -> set[str]:
    found: set[tuple[str, str]] = set()
    tmp = Path(tempfile.gettempdir())
    for p in tmp.glob("devs-sandbox-*"):
        found.add((p.name.removeprefix("devs-sandbox-"), f"workspace {p}"))
    for ctrl in [
        *Path("/sys/fs/cgroup").glob("*/devs-sandbox/*"),
        *Path("/sys/fs/cgroup").glob("devs-sandbox/*"),
    ]:
        if ctrl.is_dir():
            found.add((ctrl.name, f"cgroup {ctrl}"))
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if " - tmpfs devs-sandbox " in line:
                mnt = line.split()[4]
                found.add((Path(mnt).name.removeprefix("devs-sandbox-"), f"mount {mnt}"))
    except OSError:
        pass
    from devs_sandbox.leases import LeaseRegistry

    for lease in LeaseRegistry().directory.glob("*.json"):
        found.add((lease.stem, f"lease {lease}"))
    return {what for sandbox_id, what in found if not _foreign(sandbox_id)} | _docker_leftovers()


@pytest.fixture(scope="session", autouse=True)
def no_leftovers() -> Iterator[None]:
    """Fail the session if any sandbox resource outlives the tests that made it."""
    before = _leftovers()
    yield
    after = _leftovers() - before
    if after:
        # Another session's sandbox caught between its lease and its last resource vanishes
        # within moments; ours stays. Look again before calling it a leak.
        time.sleep(2)
        after &= _leftovers()
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    assert not after, f"sandbox resources left behind: {sorted(after)}"


# -- helpers ----------------------------------------------------------------------------
@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "violations.db"


def run_cli(
    *args: str,
    input: bytes | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The real command, as a user runs it (``python -m devs_sandbox``), no stdin."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "devs_sandbox", *args],
        input=input.decode() if input is not None else None,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        check=False,
    )

"""Drain detection against real processes: file bombs, fork bombs, deep trees, huge files."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.errors import ConfigError, QuotaExceededError
from devs_sandbox.events import SandboxEvents
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.models import ViolationType
from devs_sandbox.monitors.drain import QuotaViolation
from devs_sandbox.store import ViolationStore
from tests.helpers import config
from tests.helpers import manager as new_manager

pytestmark = pytest.mark.integration
PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"


@pytest.fixture(scope="module")
def drain_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One database for the whole module: it must hold at least two rows at the end."""
    return tmp_path_factory.mktemp("drain") / "violations.db"


@pytest.fixture
def manager(drain_db: Path) -> Iterator[SandboxLifecycleManager]:
    m = new_manager(db=drain_db)
    yield m
    m.shutdown()


def file_bomb(n: int) -> list[str]:
    """Creates up to n files until the first refusal; prints how many it managed to create
    (then idles, so only the detector ends it)."""
    script = (
        "import os\n"
        "made = 0\n"
        f"for i in range({n}):\n"
        "    try:\n"
        "        open(f'f{i}', 'w').close(); made += 1\n"
        "    except OSError:\n"
        "        break\n"  # the first refusal is the answer; print it before any kill
        "print('made', made, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    return [PY, "-c", script]


@pytest.mark.tmpfs
def test_file_bomb_is_held_at_the_limit_by_the_kernel(manager: SandboxLifecycleManager) -> None:
    counts: list[int] = []
    orig = manager.detector.evaluate

    def spy(sandbox_id: str, m: Any, **kw: Any) -> QuotaViolation:
        if m.file_count is not None:
            counts.append(m.file_count)
        return orig(sandbox_id, m, **kw)

    manager.detector.evaluate = spy  # type: ignore[method-assign]
    start = time.monotonic()
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            file_bomb(50_000),
            config(quotas={"file_count_limit": 1_000, "poll_interval_ms": 500}),
        )
    v = info.value.violation
    assert v.type == ViolationType.FILE_COUNT_EXCEEDED and v.rule == "kernel"
    assert info.value.outcome is not None
    made = int(info.value.outcome.result.stdout.text.split()[1])
    assert made == 1_000, "the kernel let files past the limit"
    assert counts and max(counts) <= 1_000, "a sample saw more files than the limit"
    assert time.monotonic() - start < 30


def test_file_bomb_without_tmpfs_is_caught_by_polling(manager: SandboxLifecycleManager) -> None:
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            file_bomb(50_000),
            config(
                quotas={"file_count_limit": 1_000, "poll_interval_ms": 300},
                isolation={"tmpfs_workspace": False},
            ),
        )
    v = info.value.violation
    assert v.type == ViolationType.FILE_COUNT_EXCEEDED
    assert v.rule in ("threshold", "growth")
    assert "tmpfs-workspace" not in info.value.outcome.isolation  # type: ignore[union-attr]


@pytest.mark.tmpfs
def test_steady_growth_is_stopped_before_the_limit(manager: SandboxLifecycleManager) -> None:
    steady = (
        "import time\n"
        "i = 0\n"
        "while True:\n"
        "    for _ in range(100):\n"
        "        open(f'f{i}', 'w').close(); i += 1\n"
        "    time.sleep(0.05)\n"
    )
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            [PY, "-c", steady],
            config(quotas={"file_count_limit": 10_000, "poll_interval_ms": 500}),
        )
    v = info.value.violation
    assert v.type == ViolationType.FILE_COUNT_EXCEEDED
    assert v.rule == "growth", v
    assert v.observed_value < 10_000
    assert "projects" in v.detail


@pytest.mark.cgroups
def test_bounded_fork_loop_under_a_limit_of_64(manager: SandboxLifecycleManager) -> None:
    loop = (
        "import os, time\n"
        "for i in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(30)\n"
    )
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            [PY, "-c", loop], config(quotas={"process_count_limit": 64, "poll_interval_ms": 300})
        )
    v = info.value.violation
    assert v.type == ViolationType.PROCESS_COUNT_EXCEEDED and v.rule == "kernel"
    assert "refused" in v.detail


def test_a_30_deep_tree_under_a_depth_limit_of_20(manager: SandboxLifecycleManager) -> None:
    deep = "/".join(["d"] * 30)
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            ["sh", "-c", f"mkdir -p {deep} && sleep 30"],
            config(quotas={"directory_depth_limit": 20, "poll_interval_ms": 300}),
        )
    v = info.value.violation
    assert v.type == ViolationType.DIRECTORY_DEPTH_EXCEEDED
    assert (v.observed_value, v.limit_value) == (30, 20)


def test_a_deep_tree_made_just_before_exit_is_still_recorded(
    manager: SandboxLifecycleManager,
) -> None:
    deep = "/".join(["d"] * 25)
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(["mkdir", "-p", deep], config(quotas={"directory_depth_limit": 20}))
    assert info.value.violation.type == ViolationType.DIRECTORY_DEPTH_EXCEEDED


@pytest.mark.parametrize(
    "writer",
    [
        ["sh", "-c", "head -c 50000000 /dev/zero > big; sleep 30"],  # killed by SIGXFSZ
        [PY, "-c", "open('big','wb').write(b'0' * 50_000_000)"],  # Python ignores SIGXFSZ
    ],
    ids=["sigxfsz", "efbig"],
)
def test_a_50mb_file_under_a_10mb_limit(
    manager: SandboxLifecycleManager, writer: list[str]
) -> None:
    with pytest.raises(QuotaExceededError) as info:
        manager.run_in_sandbox(
            writer, config(quotas={"max_file_size_bytes": 10_000_000, "poll_interval_ms": 300})
        )
    v = info.value.violation
    assert v.type == ViolationType.FILE_SIZE_EXCEEDED and v.limit_value == 10_000_000
    assert v.rule == "kernel"


def test_events_of_the_termination_chain(manager: SandboxLifecycleManager) -> None:
    seen: list[str] = []
    for name in (
        SandboxEvents.RESOURCE_DRAIN,
        SandboxEvents.SECURITY_PAUSE,
        SandboxEvents.VIOLATION,
    ):
        manager.bus.on(name, lambda e, _p: seen.append(e))
    with pytest.raises(QuotaExceededError):
        manager.run_in_sandbox(
            ["sh", "-c", "mkdir -p " + "/".join(["x"] * 5) + " && sleep 30"],
            config(quotas={"directory_depth_limit": 3, "poll_interval_ms": 200}),
        )
    assert seen == [
        SandboxEvents.RESOURCE_DRAIN,
        SandboxEvents.SECURITY_PAUSE,
        SandboxEvents.VIOLATION,
    ]


def test_injection_shaped_sandbox_id_is_rejected_or_stored_verbatim(
    manager: SandboxLifecycleManager, drain_db: Path
) -> None:
    evil = "x'); DROP TABLE sandbox_violations;--"
    with pytest.raises(ConfigError, match="invalid sandbox id"):
        manager.run_in_sandbox(["true"], config(sandbox_id=evil))
    # The detector's API takes any id (it records what it is told): stored verbatim.
    manager.detector.enforce_quota(
        QuotaViolation(True, ViolationType.FILE_COUNT_EXCEEDED, evil, 2, 1)
    )
    rows = ViolationStore(drain_db).list(sandbox_id=evil)
    assert [r["sandbox_id"] for r in rows] == [evil]
    conn = sqlite3.connect(drain_db)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name='sandbox_violations'").fetchone()


def test_zz_the_test_database_holds_the_recorded_violations(drain_db: Path) -> None:
    """Runs last in this module (pytest keeps file order)."""
    conn = sqlite3.connect(drain_db)
    (count,) = conn.execute("SELECT COUNT(*) FROM sandbox_violations").fetchone()
    assert count >= 2

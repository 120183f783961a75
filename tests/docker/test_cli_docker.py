"""``devs-sandbox run --driver docker``: the same contract as the process driver (exit
statuses, ``--json``, one violation row per killed sandbox), end to end as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.store import ViolationStore
from tests.conftest import run_cli

pytestmark = pytest.mark.docker


def run_json(*args: str, db: Path | None = None) -> tuple[int, dict[str, Any], str]:
    extra = ["--db", str(db)] if db else []
    r = run_cli("run", "--driver", "docker", "--json", *extra, *args)
    return r.returncode, json.loads(r.stdout), r.stderr


def test_run_json(docker_image: str) -> None:
    code, out, _ = run_json("--", "python3", "-c", "import os; print(os.getuid())")
    assert code == 0 and out["exit_code"] == 0
    assert out["driver"] == "docker" and out["stdout"] == "65534\n"
    assert "cap-drop-all" in out["isolation"] and "read-only-rootfs" in out["isolation"]
    assert out["violation"] is None


def test_exit_status_and_streams(docker_image: str) -> None:
    r = run_cli("run", "--driver", "docker", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7 and r.stdout == "out\n" and r.stderr == "err\n"


def test_memory_violation_exits_137_and_is_listed_once(docker_image: str, tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    code, out, stderr = run_json(
        "--memory", "32m", "--", "python3", "-c", "x = bytearray(256 * 2**20)", db=db
    )
    assert code == 137 and out["exit_code"] == 137
    assert out["violation"]["type"] == "MEMORY_EXCEEDED" and out["violation"]["rule"] == "kernel"
    assert "MEMORY_EXCEEDED" in stderr
    rows = ViolationStore(db).list()
    assert [r["violation_type"] for r in rows] == ["MEMORY_EXCEEDED"]
    assert rows[0]["sandbox_id"] == out["sandbox_id"]


def test_fork_bomb_exits_137(docker_image: str, tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    code, out, _ = run_json(
        "--max-processes",
        "32",
        "--poll-interval",
        "200",
        "--",
        "sh",
        "-c",
        "while :; do sleep 100 & done",
        db=db,
    )
    assert code == 137 and out["violation"]["type"] == "PROCESS_COUNT_EXCEEDED"
    assert ViolationStore(db).count() == 1


def test_full_workspace_exits_137(docker_image: str, tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    code, out, _ = run_json(
        "--disk", "2m", "--", "sh", "-c", "head -c 9000000 /dev/zero > big", db=db
    )
    assert code == 137 and out["violation"]["type"] == "DISK_QUOTA_EXCEEDED"
    assert ViolationStore(db).count() == 1


def test_timeout_exits_124(docker_image: str) -> None:
    code, out, _ = run_json("--timeout", "1", "--", "sleep", "60")
    assert code == 124 and out["timed_out"] is True


def test_strict_is_satisfied_by_a_container(docker_image: str) -> None:
    code, _, stderr = run_json("--strict", "--", "true")
    assert code == 0, stderr


def test_missing_runtime_is_refused_with_125(docker_image: str) -> None:
    r = run_cli("run", "--driver", "docker", "--", "cargo", "build")
    assert r.returncode == 125
    assert "rust runtime" in r.stderr and "--driver process" in r.stderr


def test_config_file_selects_docker_and_its_settings(docker_image: str, tmp_path: Path) -> None:
    cfg = tmp_path / "devs.config.json"
    cfg.write_text(
        json.dumps(
            {
                "sandbox": {
                    "driver": "docker",
                    "image": "devs-test-absent/none:1",
                    "docker": {"pullTimeoutS": 5, "fallbackImages": [docker_image]},
                }
            }
        )
    )
    r = run_cli("run", "--config", str(cfg), "--json", "--", "echo", "via config")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["driver"] == "docker" and out["stdout"] == "via config\n"

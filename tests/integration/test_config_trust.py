"""A repository's devs.config.json, attacking from the working directory an agent runs in.

Agents run ``cd repo && devs-sandbox run --copy-in . -- make test`` in repositories they just
cloned, and MCP servers start in project directories: the file there is the workload's. It
may tighten the sandbox; anything that would weaken it refuses the run before anything
runs (exit 125, one line naming the key and the file). The same file passed explicitly by
the operator (``--config``, ``DEVS_SANDBOX_CONFIG``) is honoured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.contracts import task_stderr

pytestmark = pytest.mark.integration

ATTACKS: list[tuple[dict[str, Any], str]] = [
    ({"sandbox": {"isolation": {"runAsUser": "current"}}}, "sandbox.isolation.runAsUser"),
    ({"sandbox": {"isolation": {"useBwrap": False}}}, "sandbox.isolation.useBwrap"),
    ({"sandbox": {"isolation": {"hidePaths": []}}}, "sandbox.isolation.hidePaths"),
    ({"sandbox": {"network": True}}, "sandbox.network"),
    ({"sandbox": {"fallbackDriver": "docker"}}, "sandbox.fallbackDriver"),
    ({"sandbox": {"quotas": {"memoryBytes": 64 << 30}}}, "sandbox.quotas.memoryBytes"),
    ({"sandbox": {"isolation": {"seccomp": False}}}, "sandbox.isolation.seccomp"),
]


def repo_with(tmp_path: Path, config: dict[str, Any]) -> Path:
    repo = tmp_path / "cloned-repo"
    repo.mkdir(parents=True)
    (repo / "devs.config.json").write_text(json.dumps(config))
    return repo


@pytest.mark.parametrize(("config", "key"), ATTACKS, ids=[k for _c, k in ATTACKS])
def test_a_weakening_repository_config_refuses_the_run_before_anything_runs(
    tmp_path: Path, config: dict[str, Any], key: str
) -> None:
    repo = repo_with(tmp_path, config)
    marker = tmp_path / "the-task-ran"
    r = run_cli("run", "--strict", "--", "touch", str(marker), cwd=repo)
    assert r.returncode == 125, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert key in lines[0] and "devs.config.json" in lines[0], lines[0]
    assert not marker.exists(), "the task ran under a config the workload chose"


@pytest.mark.root
def test_the_same_file_from_the_operator_is_honoured(tmp_path: Path) -> None:
    repo = repo_with(tmp_path, {"sandbox": {"isolation": {"runAsUser": "current"}}})
    explicit = run_cli(
        "run", "--config", str(repo / "devs.config.json"), "--", "id", "-u", cwd=tmp_path
    )
    assert explicit.returncode == 0, explicit.stderr
    assert explicit.stdout.strip() == str(os.geteuid())
    via_env = run_cli(
        "run",
        "--",
        "id",
        "-u",
        cwd=repo,
        env={"DEVS_SANDBOX_CONFIG": str(repo / "devs.config.json")},
    )
    assert via_env.returncode == 0 and via_env.stdout.strip() == str(os.geteuid())
    default = run_cli("run", "--", "id", "-u", cwd=tmp_path)
    assert default.stdout.strip() != str(os.geteuid()), "as root a sandbox gets its own uid"


def test_a_tightening_repository_config_is_honoured(tmp_path: Path) -> None:
    repo = repo_with(tmp_path, {"sandbox": {"timeoutMs": 1000}})
    r = run_cli("run", "--json", "--", "sleep", "5", cwd=repo)
    assert r.returncode == 124, r.stderr
    assert json.loads(r.stdout)["timed_out"] is True


def test_config_show_names_each_values_source(tmp_path: Path) -> None:
    repo = repo_with(tmp_path, {"sandbox": {"quotas": {"memoryBytes": 128 << 20}}})
    text = run_cli("config", "show", cwd=repo)
    assert text.returncode == 0
    line = next(
        ln for ln in text.stdout.splitlines() if ln.startswith("sandbox.quotas.memoryBytes")
    )
    assert str(128 << 20) in line and "devs.config.json" in line
    shown = json.loads(run_cli("config", "show", "--json", cwd=repo).stdout)
    assert shown["sources"]["sandbox.quotas.memoryBytes"].endswith("/devs.config.json")
    assert shown["sources"]["sandbox.timeoutMs"] == "default"
    bad = run_cli("config", "show", cwd=repo_with(tmp_path / "x", {"sandbox": {"network": True}}))
    assert bad.returncode == 125 and "sandbox.network" in bad.stderr


@pytest.mark.mcp
def test_an_mcp_server_started_in_the_repository_refuses_to_start(tmp_path: Path) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK (devs-sandbox[mcp]) is not installed")
    repo = repo_with(tmp_path, {"sandbox": {"isolation": {"runAsUser": "current"}}})
    r = run_cli("mcp", cwd=repo, timeout=60)
    assert r.returncode == 125, (r.returncode, r.stderr)
    assert "sandbox.isolation.runAsUser" in r.stderr
    assert len(task_stderr(r.stderr).strip().splitlines()) == 1

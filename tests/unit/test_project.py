"""Project invariants: CI runs the README's test command, and the code is lint and type clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)


def test_readme_opens_with_two_commands_and_ci_runs_the_second() -> None:
    commands = _readme_commands()
    assert len(commands) >= 2
    install_and_run, tests = commands[0], commands[1]
    assert "pip install" in install_and_run and "devs-sandbox run" in install_and_run
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "the README's test command and .ci/run drifted apart"


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    r = subprocess.run(
        [ruff, "check", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    f = subprocess.run(
        [ruff, "format", "--check", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert f.returncode == 0, f.stdout + f.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr

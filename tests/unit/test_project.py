"""Project invariants: CI runs the README's test command, and the code is lint and type clean."""

from __future__ import annotations

import re
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


def test_ci_runs_lint_types_and_the_layering_contract_as_a_step_of_its_own() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in (
        "ruff check src tests benchmarks",
        "ruff format --check src tests benchmarks",
        "mypy",
        "lint-imports",
    ):
        assert command in ci, f"CI no longer runs `{command}`"

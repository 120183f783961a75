"""Sandbox ids: what is allowed, and what a crafted id cannot become."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devs_sandbox.errors import InvalidSandboxIdError, SandboxCommandError
from devs_sandbox.models import (
    CapturedStream,
    ExecResult,
    SandboxOutcome,
    Violation,
    ViolationType,
    new_sandbox_id,
    validate_sandbox_id,
)
from devs_sandbox.tools.outputs import OutputImage, OutputImages, SkippedImage
from tests.contracts import RESOURCE_KEYS, RUN_JSON_KEYS

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("good", ["sb-1", "A.b_c-9", "x" * 64, new_sandbox_id()])
def test_valid_ids(good: str) -> None:
    assert validate_sandbox_id(good) == good


@pytest.mark.parametrize(
    "bad", ["", "x" * 65, "../etc", "a/b", "a b", ".", "..", "x'); DROP TABLE t;--", "é", "a\n"]
)
def test_invalid_ids(bad: str) -> None:
    with pytest.raises(InvalidSandboxIdError, match="invalid sandbox id"):
        validate_sandbox_id(bad)


def result(code: int) -> ExecResult:
    return ExecResult(code, CapturedStream("o"), CapturedStream("e"), 0.5)


def test_outcome_exit_codes_follow_timeout1() -> None:
    assert SandboxOutcome("s", "process", (), result(3)).exit_code == 3
    assert SandboxOutcome("s", "process", (), result(137), timed_out=True).exit_code == 124
    viol = Violation("s", ViolationType.MEMORY_EXCEEDED, 2, 1)
    assert SandboxOutcome("s", "process", (), result(137), violation=viol).exit_code == 137


def test_raise_for_status_is_opt_in() -> None:
    ok = SandboxOutcome("s", "process", (), result(0))
    assert ok.raise_for_status() is ok
    with pytest.raises(SandboxCommandError) as info:
        SandboxOutcome("s", "process", (), result(2)).raise_for_status()
    assert info.value.outcome is not None


def test_json_contract_keys() -> None:
    out = SandboxOutcome("s", "process", ("rlimits",), result(0)).to_json()
    assert set(out) >= RUN_JSON_KEYS
    assert set(out["resources"]) == RESOURCE_KEYS


def test_every_json_field_is_documented_in_the_readme() -> None:
    """`run --json` emits nothing the README's --json paragraph does not name."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = text[text.index("`--json` prints") :].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    out = SandboxOutcome("s", "process", ("rlimits",), result(0)).to_json()
    assert set(out) - named == set()
    assert set(out["resources"]) - named == set()
    # `--code` runs add the images their program left (and `path` with --outputs).
    code = OutputImages(
        (OutputImage("a.png", "image/png", b"\x89PNG\r\n\x1a\n"),),
        (SkippedImage("b.png", "a symbolic link: not followed", 11),),
    ).to_json()
    assert set(code) - named == set()
    keys = {*code["images"][0], "path", *code["skipped_images"][0]}
    assert keys - named == set()

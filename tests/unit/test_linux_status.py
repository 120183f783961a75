"""Exit statuses decoded from what the launchers report."""

from __future__ import annotations

import pytest

from devs_sandbox.drivers.linux import bwrap_exec_failure

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("code", "stderr", "expected"),
    [
        (1, "bwrap: execvp nope: No such file or directory\n", 127),
        (1, "bwrap: execvp nope: Not a directory\n", 127),
        (1, "bwrap: execvp nope: Permission denied\n", 126),
        (1, "bwrap: execvp nope: Exec format error\n", 126),
        (2, "bwrap: execvp nope: No such file or directory\n", None),  # not bwrap's exit
        (1, "bwrap: execvp other: No such file or directory\n", None),  # another argv0
        (1, "bwrap: execvp nope: No such file or directory\nmore\n", None),  # the task's
        (1, "", None),
    ],
)
def test_bwrap_exec_failure(code: int, stderr: str, expected: int | None) -> None:
    assert bwrap_exec_failure("nope", code, stderr) == expected

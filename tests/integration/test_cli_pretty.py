"""violations, doctor and image build's progress: rich on a terminal (a real pseudo-terminal
here), exactly the old plain text on a pipe, which scripts parse."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from devs_sandbox.cli.commands import _BuildProgress
from devs_sandbox.cli.pretty import BuildProgress as Live
from devs_sandbox.images import BuildProgress
from devs_sandbox.models import DetectionRule, Violation, ViolationType
from devs_sandbox.store import ViolationStore
from tests.conftest import run_cli
from tests.helpers import run_python

pytestmark = pytest.mark.integration

BOX = re.compile("[┃│━─┏┡└┗]")
RED = "\x1b[31m"


def _open_pty(columns: int = 160) -> tuple[int, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    return master, slave


def _read_all(master: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every slave end is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def run_on_terminal(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The CLI with its stdout on a pseudo-terminal; returns (status, what the terminal got)."""
    master, slave = _open_pty()
    full_env = {**os.environ, "PYTHONIOENCODING": "utf-8", "TERM": "xterm-256color"}
    full_env.pop("NO_COLOR", None)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "devs_sandbox", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=full_env,
    )
    os.close(slave)
    out = _read_all(master)
    proc.wait(120)
    assert proc.stderr is not None
    assert proc.returncode == 0, proc.stderr.read()
    return proc.returncode, out


@pytest.fixture
def violations_db(tmp_path: Path) -> Path:
    db = tmp_path / "v.db"
    with ViolationStore(db) as store:
        store.record(
            Violation(
                "sb-pretty-[bold]x",  # markup-shaped: must be printed verbatim
                ViolationType.MEMORY_EXCEEDED,
                200,
                100,
                DetectionRule.THRESHOLD,
                "d",
            )
        )
    return db


def test_violations_on_a_terminal_is_a_rich_table(violations_db: Path) -> None:
    _, out = run_on_terminal("violations", "--db", str(violations_db))
    assert BOX.search(out), out
    assert "sb-pretty-[bold]x" in out and "MEMORY_EXCEEDED" in out and RED in out


def test_no_color_keeps_the_table_without_colours(violations_db: Path) -> None:
    _, out = run_on_terminal("violations", "--db", str(violations_db), env={"NO_COLOR": "1"})
    assert BOX.search(out) and "MEMORY_EXCEEDED" in out
    assert RED not in out


def test_violations_on_a_pipe_is_the_plain_table(violations_db: Path) -> None:
    r = run_cli("violations", "--db", str(violations_db))
    assert r.returncode == 0, r.stderr
    with ViolationStore(violations_db) as store:
        (row,) = store.list()
    header = ("terminated_at", "sandbox_id", "violation_type", "observed", "limit", "rule")
    cells = (row["terminated_at"], "sb-pretty-[bold]x", "MEMORY_EXCEEDED", "200", "100")
    cells += (row["rule"],)
    widths = [max(len(a), len(b)) for a, b in zip(header, cells, strict=True)]
    expected = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, cells)
    ]
    assert r.stdout.splitlines() == expected
    assert "\x1b" not in r.stdout


def test_doctor_on_a_terminal_is_a_rich_table() -> None:
    _, out = run_on_terminal("doctor")
    assert BOX.search(out), out
    assert "mechanism" in out and "rlimits" in out and "store" in out


def test_doctor_on_a_pipe_is_plain_text() -> None:
    r = run_cli("doctor")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("devs-sandbox doctor (python ") and lines[1] == ""
    assert re.match(r"^  rlimits +(yes|no) ", r.stdout.splitlines()[2] + " ")
    assert not BOX.search(r.stdout) and "\x1b" not in r.stdout


STEPS = [
    BuildProgress("check", "looking for the image", 0.0),
    BuildProgress("debootstrap", "fetching", 1.0, 10),
    BuildProgress("debootstrap", "unpacking", 2.0, 70),
    BuildProgress("import", "docker import", 3.0),
    BuildProgress("done", "built", 4.0),
]


def test_build_progress_on_a_pipe_is_one_line_per_phase_and_per_50_steps() -> None:
    out = io.StringIO()
    with _BuildProgress(out) as show:
        for step in STEPS:
            show(step)
    assert out.getvalue().splitlines() == [
        "[   0.0s] check        looking for the image",
        "[   1.0s] debootstrap   10 steps  fetching",
        "[   2.0s] debootstrap   70 steps  unpacking",
        "[   3.0s] import       docker import",
        "[   4.0s] done         built",
    ]


def test_build_progress_on_a_terminal_is_rich_live_display(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master, slave = _open_pty()
    monkeypatch.delenv("NO_COLOR", raising=False)
    with open(slave, "w", encoding="utf-8", closefd=True) as term, Live(term) as show:
        for step in STEPS:
            show(step)
    out = _read_all(master)
    assert "\x1b[?25l" in out  # the live display hid the cursor: rich drew on a terminal
    for kept in ("check        looking for the image", "import       docker import", "built"):
        assert kept in out


def test_run_in_process_loads_none_of_these_libraries() -> None:
    """rich and platformdirs cost 10-50 ms each to import: ``run`` (here in
    process, where the whole library is loaded) needs none of them."""
    probe = (
        "import sys\n"
        "from devs_sandbox.cli.fast import main\n"
        "status = main(['run', '--', 'true'])\n"
        "print(status, sorted({m.split('.')[0] for m in sys.modules} & "
        "{'rich', 'platformdirs'}))\n"
    )
    r = run_python(probe, env={"DEVS_SANDBOX_DAEMON": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(maxsplit=1) == ["0", "[]\n"], (r.stdout, r.stderr)

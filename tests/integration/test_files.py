"""Files in and out of a live sandbox on the process driver: read, write, list, copy-out,
and every way a path could leave the workspace, tried as the task would plant it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devs_sandbox.errors import SandboxFileError
from tests.helpers import config, manager

pytestmark = pytest.mark.integration

BINARY = bytes(range(256)) * 64  # every byte value, NUL and invalid UTF-8 included


@pytest.fixture
def sandbox():  # type: ignore[no-untyped-def]
    m = manager()
    with m.open_sandbox(config()) as sb:
        yield sb
    m.shutdown()


def test_write_read_and_list_round_trip_bytes(sandbox) -> None:  # type: ignore[no-untyped-def]
    sandbox.write_file("out/data.bin", BINARY)
    sandbox.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.read_file("out/data.bin") == BINARY
    assert sandbox.exec(["./run.sh"]).stdout.text == "ran\n"
    names = {(e.name, e.kind, e.size_bytes) for e in sandbox.list_files(".")}
    assert ("out", "directory") in {(n, k) for n, k, _ in names}
    assert ("run.sh", "file", len("#!/bin/sh\necho ran\n")) in names
    made_by_task = sandbox.exec(["sh", "-c", "printf 'from the task' > note.txt"])
    assert made_by_task.exit_code == 0
    assert sandbox.read_file("note.txt") == b"from the task"


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../x", "", "a\0b"])
def test_paths_out_of_the_workspace_are_refused_before_anything_runs(
    sandbox,
    path: str,  # type: ignore[no-untyped-def]
) -> None:
    with pytest.raises(SandboxFileError, match="inside the workspace"):
        sandbox.read_file(path)
    with pytest.raises(SandboxFileError, match="inside the workspace"):
        sandbox.write_file(path, b"x")


def test_a_symlink_the_task_planted_leads_nowhere(sandbox, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host_file = tmp_path / "host-secret"
    host_file.write_text("host")
    plant = (
        "ln -s /etc/passwd passwd; ln -s / root; mkdir d; ln -s /tmp d/tmp; "
        f"ln -s {tmp_path} hostdir"
    )
    assert sandbox.exec(["sh", "-c", plant]).exit_code == 0
    for path in ("passwd", "root/etc/passwd", "d/tmp/x"):
        with pytest.raises(SandboxFileError, match=r"outside the workspace|no such"):
            sandbox.read_file(path)
    with pytest.raises(SandboxFileError, match="outside the workspace"):
        sandbox.write_file("passwd", b"owned")  # never written through the link
    with pytest.raises(SandboxFileError, match=r"outside the workspace|no such"):
        sandbox.write_file("hostdir/planted", b"x")
    assert not (tmp_path / "planted").exists()
    assert Path("/etc/passwd").read_text().startswith("root:")


def test_size_limits_hold(sandbox) -> None:  # type: ignore[no-untyped-def]
    assert sandbox.exec(["sh", "-c", "head -c 100000 /dev/zero > big"]).exit_code == 0
    with pytest.raises(SandboxFileError, match="larger than the limit"):
        sandbox.read_file("big", max_bytes=99_999)
    assert len(sandbox.read_file("big", max_bytes=100_000)) == 100_000
    with pytest.raises(SandboxFileError, match="not a regular file"):
        sandbox.read_file(".")
    with pytest.raises(SandboxFileError, match="no such"):
        sandbox.read_file("missing")


def test_copy_out_a_tree_stays_in_its_destination(sandbox, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    script = (
        "mkdir -p results/sub && echo a > results/a.txt && echo b > results/sub/b.txt && "
        "ln -s a.txt results/link && ln -s /etc/shadow results/escape; chmod 4755 results/a.txt"
    )
    assert sandbox.exec(["sh", "-c", script]).exit_code == 0
    dest = tmp_path / "dest"
    with pytest.raises(SandboxFileError, match="could not copy out"):
        sandbox.copy_out("results", dest)  # a link out of the tree refuses the whole copy
    assert not (dest / "results" / "escape").exists()
    assert sandbox.exec(["rm", "results/escape"]).exit_code == 0
    got = sandbox.copy_out("results", dest)
    assert got == dest / "results"
    assert (got / "a.txt").read_text() == "a\n" and (got / "sub" / "b.txt").read_text() == "b\n"
    assert os.readlink(got / "link") == "a.txt"
    assert not (got / "a.txt").stat().st_mode & 0o7000, "setuid bit kept"
    with pytest.raises(SandboxFileError, match="larger than the limit"):
        sandbox.copy_out("results", tmp_path / "small", max_bytes=1)

"""The file API on the Docker driver: the same commands, inside the container."""

from __future__ import annotations

from pathlib import Path

import pytest

from devs_sandbox.errors import SandboxFileError
from devs_sandbox.lifecycle import SandboxLifecycleManager
from tests.docker.conftest import dconfig

pytestmark = pytest.mark.docker


def test_files_in_and_out_of_a_container(manager: SandboxLifecycleManager, tmp_path: Path) -> None:
    data = bytes(range(256)) * 16
    with manager.open_sandbox(dconfig()) as sb:
        sb.write_file("in/data.bin", data)
        assert sb.exec(
            ["sh", "-c", "cmp in/data.bin in/data.bin && wc -c < in/data.bin"]
        ).stdout.text.strip() == str(len(data))
        assert sb.read_file("in/data.bin") == data
        assert [e.name for e in sb.list_files("in")] == ["data.bin"]
        assert sb.exec(["sh", "-c", "ln -s /etc/hostname in/host"]).exit_code == 0
        with pytest.raises(SandboxFileError, match="outside the workspace"):
            sb.read_file("in/host")
        with pytest.raises(SandboxFileError, match="could not copy out"):
            sb.copy_out("in", tmp_path / "out")
        assert sb.exec(["rm", "in/host"]).exit_code == 0
        got = sb.copy_out("in", tmp_path / "out")
        assert (got / "data.bin").read_bytes() == data


def test_run_code_answers_with_the_runtime_gate(manager: SandboxLifecycleManager) -> None:
    """The default image declares python only: node code is refused before anything runs."""
    from devs_sandbox.errors import UnsupportedRuntimeError
    from devs_sandbox.tools.code import run_code

    out = run_code("print(6 * 7)", "python", dconfig(), manager=manager)
    assert out.exit_code == 0 and out.result.stdout.text == "42\n"
    with pytest.raises(UnsupportedRuntimeError, match="node"):
        run_code("console.log(1)", "node", dconfig(), manager=manager)


def test_run_code_returns_images_on_docker(manager: SandboxLifecycleManager) -> None:
    """``$DEVS_SANDBOX_OUTPUT_DIR`` is the container's own path to outputs/, and what the
    program leaves there comes back as on the process driver."""
    from devs_sandbox.tools.code import run_code
    from tests.integration.test_run_code_images import PROGRAM, RETURNED, check_skipped

    got = run_code(PROGRAM, "python", dconfig(), manager=manager)
    assert got.exit_code == 3, got.result.stderr.text
    assert {i.name: i.mime_type for i in got.images.images} == RETURNED
    check_skipped([s.to_json() for s in got.images.skipped])

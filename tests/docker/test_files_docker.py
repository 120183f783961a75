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

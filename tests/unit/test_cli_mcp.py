"""``devs-sandbox mcp`` as a CLI: its options, and the install hint when the SDK is missing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import devs_sandbox
from devs_sandbox.cli import main as cli

pytestmark = pytest.mark.unit


def test_without_the_sdk_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "devs_sandbox.mcp_server", raising=False)
    monkeypatch.delattr(devs_sandbox, "mcp_server", raising=False)  # else no re-import
    assert cli.main(["mcp"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'devs-sandbox[mcp]'" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.mcp
def test_options_reach_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mcp")
    from devs_sandbox import mcp_server

    seen: dict[str, Any] = {}

    def serve(config: Any, **kw: Any) -> int:
        seen.update(kw, config=config)
        return 0

    monkeypatch.setattr(mcp_server, "serve", serve)
    db = tmp_path / "v.db"
    assert cli.main(["mcp", "--http", "--port", "9123", "--db", str(db)]) == 0
    assert seen["http"] is True and seen["port"] == 9123 and seen["host"] == "127.0.0.1"
    assert seen["db_path"] == db
    assert cli.main(["mcp", "--http", "--host", "0.0.0.0"]) == 0  # noqa: S104 - the warning
    assert "no authentication" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mcp", "--port", port]) == 2
    assert "port" in capsys.readouterr().err

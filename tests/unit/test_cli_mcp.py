"""``devs-sandbox mcp`` as a CLI: its options, and the install hint when the SDK is missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import devs_sandbox
from devs_sandbox.cli import main as cli
from devs_sandbox.config import DevsConfig
from devs_sandbox.errors import ConfigError

pytestmark = pytest.mark.unit


def test_without_the_sdk_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp -> ModuleNotFoundError
    for name in [m for m in sys.modules if m.split(".")[:2] == ["devs_sandbox", "mcp_server"]]:
        monkeypatch.delitem(sys.modules, name)  # the package and its modules, re-imported
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
    assert seen["db_path"] == db and seen["auth_token"] is None
    token = _token_file(tmp_path, "s3cret-token-0123456789\n")
    args = ["mcp", "--http", "--host", "0.0.0.0", "--auth-token-file", str(token)]  # noqa: S104
    assert cli.main(args) == 0
    assert seen["auth_token"] == "s3cret-token-0123456789" and seen["host"] == "0.0.0.0"  # noqa: S104
    err = capsys.readouterr().err
    assert "clear text" in err and "s3cret" not in err


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.mcp
@pytest.mark.parametrize(
    ("text", "mode", "expect"),
    [
        ("0123456789abcdef0123\n", 0o644, "mode 0644: group or others may access it"),
        ("0123456789abcdef0123\n", 0o620, "mode 0620"),
        ("0123456789abcdef0123\n", 0o601, "mode 0601"),
        ("\n", 0o600, "is empty"),
        ("", 0o400, "is empty"),
        ("short\n", 0o600, "has 5 characters; use at least 16"),
        ("two words in a token\n", 0o600, "printable ASCII without spaces"),
        ("0123456789abcdef\nsecond line\n", 0o600, "printable ASCII without spaces"),
        ("x" * 5000, 0o600, "over 4096 bytes"),
    ],
)
def test_a_bad_token_file_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, mode: int, expect: str
) -> None:
    pytest.importorskip("mcp")
    path = _token_file(tmp_path, text, mode)
    assert cli.main(["mcp", "--http", "--auth-token-file", str(path)]) == 125
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1 and "Traceback" not in err
    assert "0123456789abcdef" not in err  # the token itself is never printed


@pytest.mark.mcp
def test_a_good_token_file(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from devs_sandbox import mcp_server

    assert mcp_server.read_auth_token(_token_file(tmp_path, "tok-0123456789abcdef\r\n")) == (
        "tok-0123456789abcdef"
    )
    assert mcp_server.read_auth_token(_token_file(tmp_path, "tok-0123456789abcdef", 0o400))
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"cannot read token file .*nope: No such file"):
        mcp_server.read_auth_token(missing)


@pytest.mark.mcp
@pytest.mark.root
def test_a_token_file_of_another_user_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mcp")
    path = _token_file(tmp_path, "0123456789abcdef0123")
    os.chown(path, 65534, 65534)
    assert cli.main(["mcp", "--http", "--auth-token-file", str(path)]) == 125
    assert "belongs to uid 65534, neither this user nor root" in capsys.readouterr().err


@pytest.mark.mcp
@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),  # noqa: S104
        ("::", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
    ],
)
def test_only_loopback_binds_go_without_a_token(host: str, loopback: bool) -> None:
    pytest.importorskip("mcp")
    from devs_sandbox import mcp_server

    assert mcp_server.is_loopback(host) is loopback


@pytest.mark.mcp
def test_the_non_loopback_rule_and_the_token_file_need_http(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mcp")
    from devs_sandbox import mcp_server

    called: list[Any] = []
    monkeypatch.setattr(mcp_server, "serve", lambda *a, **kw: called.append(kw) or 0)
    assert cli.main(["mcp", "--http", "--host", "0.0.0.0"]) == 125  # noqa: S104
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without --auth-token-file" in err
    assert err.count("\n") == 1
    token = _token_file(tmp_path, "0123456789abcdef0123")
    assert cli.main(["mcp", "--auth-token-file", str(token)]) == 2
    assert "--auth-token-file needs --http" in capsys.readouterr().err
    assert called == []
    # serve() itself refuses too, for library callers.
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="without --auth-token-file"):
        mcp_server.serve(DevsConfig(), db_path=tmp_path / "v.db", http=True, host="::")


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mcp", "--port", port]) == 2
    assert "port" in capsys.readouterr().err

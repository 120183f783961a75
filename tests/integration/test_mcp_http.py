"""The real ``devs-sandbox mcp --http`` process, attacked the way another tenant would.

Two MCP sessions of the SDK's own client over streamable HTTP on 127.0.0.1: the second
knows the first one's sandbox id and tries to run a command in it, destroy it and read
its violation rows (both sessions caused real ones: a memory hog killed by a low RSS
limit); the first keeps working, and its sandbox goes when its session ends (the
client's DELETE), while the other's stays until the server stops. Then the bearer token
(no or a wrong token: 401 and nothing runs; the right one works), the refusal of a
non-loopback bind without a token (exit 125, one line) and of a token file others can
read. Helpers and leftover checks are those of test_mcp_stdio.py.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.contracts import tool_answer
from tests.integration.helpers import processes_with, wait_for
from tests.integration.test_mcp_stdio import (
    PY,
    Server,
    _accepts,
    _free_port,
    bg,
    error_text,
    marker,
)

pytestmark = [pytest.mark.integration, pytest.mark.mcp]
START_TIMEOUT_S = 60  # importing the package and the SDK on a loaded host
STOP_TIMEOUT_S = 30
HOG = f"{PY} -c \"import time; x = b'x' * (160 << 20); time.sleep(120)\""
RSS_KILL = {"command": HOG, "rss_limit_bytes": 64 << 20, "poll_interval_ms": 100}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"},
    },
}
MCP_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


class HttpServer:
    """One ``devs-sandbox mcp --http`` on a free loopback port; stderr goes to a file."""

    def __init__(self, tmp_path: Path, *, token: str | None = None) -> None:
        self.server = Server(tmp_path)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.args = [*self.server.args, "--http", "--port", str(self.port)]
        if token is not None:
            path = tmp_path / "token"
            path.write_text(token + "\n")
            path.chmod(0o600)
            self.args += ["--auth-token-file", str(path)]
        self.log = tmp_path / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> HttpServer:
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.server.pids.add(self.proc.pid)
        proc = self.proc
        assert wait_for(lambda: _accepts(self.port) or proc.poll() is not None, START_TIMEOUT_S)
        assert proc.poll() is None, self.stderr()
        return self

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(STOP_TIMEOUT_S)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A test that failed half-way still lets the server destroy its sandboxes.
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @contextlib.asynccontextmanager
    async def client(
        self, *, token: str | None = None, mode: str = "auto", statuses: list[int] | None = None
    ) -> AsyncIterator[Client]:
        """The SDK's client; ``token`` goes in every request's Authorization header, and
        the HTTP status of every response is appended to ``statuses``."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}

        async def record(response: httpx2.Response) -> None:
            if statuses is not None:
                statuses.append(response.status_code)

        async with httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(30, read=300),
            event_hooks={"response": [record]},
        ) as http:
            transport = streamable_http_client(self.url, http_client=http)
            async with Client(transport, mode=mode) as client:
                yield client


async def _rows(server: Server, client: Client, **args: Any) -> list[dict[str, Any]]:
    r = await server.call(client, "sandbox_violations", args)
    assert not r.is_error and tool_answer(r) is not None, r
    rows: list[dict[str, Any]] = tool_answer(r)["violations"]
    return rows


async def _rss_kill(server: Server, client: Client, tool: str, **args: Any) -> None:
    r = await server.call(client, tool, {**RSS_KILL, **args})
    assert tool_answer(r) is not None and tool_answer(r).get("reason") == "rss", r


async def _gone(path: Path, timeout_s: float = 30) -> bool:
    with anyio.move_on_after(timeout_s):
        while path.exists():
            await anyio.sleep(0.05)
    return not path.exists()


def test_one_session_cannot_reach_another_sessions_sandboxes(tmp_path: Path) -> None:
    with HttpServer(tmp_path) as http:
        srv = http.server

        async def main() -> None:
            # The SDK's default client (mode="auto") gets a session: discover says so.
            async with http.client() as bob:
                async with http.client() as alice:
                    r = await srv.call(alice, "sandbox_create", {})
                    assert not r.is_error and tool_answer(r) is not None, r
                    sid = tool_answer(r)["sandbox_id"]
                    alices_workspace = Path(tool_answer(r)["workspace"])
                    write = {"sandbox_id": sid, "command": "echo secret > notes.txt"}
                    assert not (await srv.call(alice, "sandbox_exec", write)).is_error
                    # Real violations: in her sandbox, and in a one-shot run of hers.
                    await _rss_kill(srv, alice, "sandbox_exec", sandbox_id=sid)
                    await _rss_kill(srv, alice, "run_shell_monitored")
                    alices = {row["sandbox_id"] for row in await _rows(srv, alice)}
                    assert len(alices) == 2 and sid in alices

                    # Bob knows her id. He gets what an id that never existed gets.
                    never = await srv.call(
                        bob, "sandbox_exec", {"sandbox_id": "sb-000000000000", "command": "ls"}
                    )
                    for tool, args in (
                        ("sandbox_exec", {"sandbox_id": sid, "command": "cat notes.txt"}),
                        ("sandbox_destroy", {"sandbox_id": sid}),
                    ):
                        r = await srv.call(bob, tool, args)
                        assert error_text(r) == error_text(never).replace("sb-000000000000", sid)
                        assert tool_answer(r) == {
                            "error": "sandbox_not_found",
                            "sandbox_id": sid,
                            "detail": "",
                        }
                    assert await _rows(srv, bob) == []
                    assert await _rows(srv, bob, sandbox_id=sid) == []
                    # His own violation is his, and hers stay out of his list.
                    await _rss_kill(srv, bob, "run_shell_monitored")
                    bobs = {row["sandbox_id"] for row in await _rows(srv, bob)}
                    assert len(bobs) == 1 and not bobs & alices

                    # Alice carries on as if nothing happened.
                    read = {"sandbox_id": sid, "command": "cat notes.txt"}
                    r = await srv.call(alice, "sandbox_exec", read)
                    assert tool_answer(r) is not None, r
                    assert tool_answer(r)["stdout"] == "secret\n"
                    r = await srv.call(bob, "sandbox_create", {})
                    assert tool_answer(r) is not None, r
                    bobs_sid = tool_answer(r)["sandbox_id"]
                    bobs_workspace = Path(tool_answer(r)["workspace"])
                    assert alices_workspace.is_dir()
                # Alice's client left (its DELETE ended the session): her sandbox is gone,
                # Bob's is not, and he learns nothing about hers.
                assert await _gone(alices_workspace), "the session ended, its sandbox did not"
                assert bobs_workspace.is_dir()
                r = await srv.call(bob, "sandbox_exec", {"sandbox_id": sid, "command": "ls"})
                assert error_text(r) == f"no such sandbox: '{sid}'"
                r = await srv.call(bob, "sandbox_exec", {"sandbox_id": bobs_sid, "command": "pwd"})
                assert tool_answer(r) is not None, r
                assert tool_answer(r)["stdout"] == f"{bobs_workspace}\n"

        anyio.run(main)
        assert http.stop() == 128 + signal.SIGTERM
    srv.assert_nothing_left()


def test_server_exit_destroys_the_sandboxes_of_open_sessions(tmp_path: Path) -> None:
    tag = marker()
    with HttpServer(tmp_path) as http:
        srv = http.server

        async def main() -> None:
            async with http.client() as client:
                r = await srv.call(client, "sandbox_create", {})
                assert tool_answer(r) is not None, r
                sid = tool_answer(r)["sandbox_id"]
                workspace = Path(tool_answer(r)["workspace"])

                async def doomed() -> None:
                    # Its answer never comes: the server stops under it.
                    with contextlib.suppress(Exception):
                        await srv.call(
                            client, "sandbox_exec", {"sandbox_id": sid, "command": bg(tag)}
                        )

                async with anyio.create_task_group() as tg:
                    tg.start_soon(doomed)
                    with anyio.fail_after(60):
                        while not processes_with(tag):
                            await anyio.sleep(0.05)
                    status = await anyio.to_thread.run_sync(http.stop)
                    assert status == 128 + signal.SIGTERM
                    tg.cancel_scope.cancel()
                assert not workspace.exists()

        anyio.run(main)
    assert not processes_with(tag)
    srv.assert_nothing_left()


def test_a_loopback_server_checks_host_and_origin(tmp_path: Path) -> None:
    """DNS rebinding: a page whose name now points at 127.0.0.1 sends its own Host/Origin."""
    with HttpServer(tmp_path) as http:
        body = json.dumps(INITIALIZE)
        evil_host = {**MCP_HEADERS, "host": f"attacker.example:{http.port}"}
        assert httpx2.post(http.url, headers=evil_host, content=body).status_code == 421
        evil_origin = {**MCP_HEADERS, "origin": "http://attacker.example"}
        assert httpx2.post(http.url, headers=evil_origin, content=body).status_code == 403
        ok = httpx2.post(http.url, headers=MCP_HEADERS, content=body)
        assert ok.status_code == 200 and ok.headers.get("mcp-session-id")
        assert http.stop() == 128 + signal.SIGTERM
    http.server.assert_nothing_left()


def test_the_bearer_token(tmp_path: Path) -> None:
    token = secrets.token_hex(24)
    with HttpServer(tmp_path, token=token) as http:
        srv = http.server
        body = json.dumps(INITIALIZE)
        refused = [
            {},
            {"authorization": f"Bearer {token[:-1]}"},
            {"authorization": f"Bearer {token}x"},
            {"authorization": f"Basic {token}"},
            {"authorization": token},
        ]
        for headers in refused:
            for method in ("POST", "GET", "DELETE"):
                r = httpx2.request(
                    method, http.url, headers={**MCP_HEADERS, **headers}, content=body
                )
                assert r.status_code == 401, (method, headers, r.status_code)
                assert r.headers["www-authenticate"].startswith("Bearer"), r.headers
                assert "mcp-session-id" not in r.headers
        ok = httpx2.post(
            http.url, headers={**MCP_HEADERS, "authorization": f"bearer {token}"}, content=body
        )
        assert ok.status_code == 200 and ok.headers.get("mcp-session-id")

        async def main() -> None:
            # The sessionless protocol sends the tool call itself as the first request: with
            # no or a wrong token it is refused and nothing runs (no violation row).
            for wrong in (None, token[::-1]):
                statuses: list[int] = []
                with pytest.raises(Exception):  # noqa: B017 - the SDK says only "error response"
                    async with http.client(
                        token=wrong, mode="2026-07-28", statuses=statuses
                    ) as client:
                        await srv.call(client, "run_shell_monitored", RSS_KILL)
                assert statuses and set(statuses) == {401}, statuses
            assert srv.violation_rows() == []
            async with http.client(token=token, mode="2026-07-28") as client:
                await _rss_kill(srv, client, "run_shell_monitored")
            assert len(srv.violation_rows()) == 1
            async with http.client(token=token) as client:
                r = await srv.call(client, "sandbox_create", {})
                assert not r.is_error, r

        anyio.run(main)
        assert http.stop() == 128 + signal.SIGTERM
        assert token not in http.stderr()
    srv.assert_nothing_left()


def _refusal(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Start a server that must refuse to start; a server that starts anyway is killed."""
    server = Server(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, *server.args, "--http", "--port", str(_free_port()), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the server started with {args}")
    return proc.returncode, err.decode()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])  # noqa: S104
def test_a_non_loopback_bind_without_a_token_is_refused(tmp_path: Path, host: str) -> None:
    status, err = _refusal(tmp_path, "--host", host)
    assert status == 125
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"refusing to listen on {host} without --auth-token-file" in err


@pytest.mark.parametrize(
    ("text", "mode", "expect"),
    [
        ("0123456789abcdef0123", 0o644, "mode 0644: group or others may access it; run chmod 600"),
        ("", 0o600, "is empty"),
    ],
)
def test_a_bad_token_file_is_refused(tmp_path: Path, text: str, mode: int, expect: str) -> None:
    path = tmp_path / "token"
    path.write_text(text + "\n")
    path.chmod(mode)
    status, err = _refusal(tmp_path, "--host", "0.0.0.0", "--auth-token-file", str(path))  # noqa: S104
    assert status == 125
    assert err.count("\n") == 1 and expect in err and "0123456789" not in err

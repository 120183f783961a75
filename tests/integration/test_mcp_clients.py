"""The real ``devs-sandbox mcp`` under the official clients that nobody on this project wrote:
the TypeScript SDK client (what most agent hosts embed) driven through Node, the MCP
Inspector's CLI, and the Python SDK client.

What each must show is our own message, not a client-side validation error: bad
arguments, an unknown sandbox, a second destroy. (The TypeScript client and the
Inspector validate ``structuredContent`` against a tool's ``outputSchema`` even on
errors; an error result of another shape made them throw "Structured content does not
match the tool's output schema".) And a call longer than the TypeScript client's 60 s
default request timeout completes when the client resets that timeout on progress.

The Node clients are pinned in tests/mcp_clients/package-lock.json (``npm ci`` there;
.ci/run does it). Without Node or those packages the tests skip (fail under
DEVS_SANDBOX_REQUIRE_ALL=1).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from mcp import Client

from tests.contracts import SHELL_OUTPUT_KEYS, tool_answer
from tests.integration.test_mcp_stdio import CALL_TIMEOUT_S, Server, error_text

pytestmark = [pytest.mark.integration, pytest.mark.mcp]
CLIENTS = Path(__file__).resolve().parents[1] / "mcp_clients"
NODE_TIMEOUT_S = 300  # the whole client run, on a loaded host
# The done-when of issue 13 says a 90 s call; a developer may shorten it locally (>= 61 s
# still proves the 60 s default timeout was outlived).
LONG_CALL_S = float(os.environ.get("DEVS_SANDBOX_TEST_LONG_CALL_S", "90"))
NEVER = "sb-000000000000"

# What every client must show: our first text block, verbatim (or its start).
BAD_ARGUMENTS = (
    "run_shell_monitored",
    {"command": "echo x", "timeout": 5},
    "invalid arguments for run_shell_monitored: timeout: unknown argument",
)
UNKNOWN_SANDBOX = (
    "sandbox_exec",
    {"sandbox_id": NEVER, "command": "ls"},
    f"no such sandbox: '{NEVER}'",
)


def server_args(server: Server) -> dict[str, Any]:
    return {"command": sys.executable, "args": server.args, "cwd": str(server.db.parent)}


class TsClient:
    """tests/mcp_clients/ts_client.mjs against a fresh server, started at once; ``report``
    waits for its JSON report."""

    def __init__(self, tmp_path: Path, server: Server, calls: list[dict[str, Any]]) -> None:
        self.server = server
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({**server_args(server), "calls": calls}))
        self.proc = subprocess.Popen(
            ["node", str(CLIENTS / "ts_client.mjs"), str(spec)],
            cwd=CLIENTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def report(self) -> dict[str, Any]:
        try:
            out, err = self.proc.communicate(timeout=NODE_TIMEOUT_S)
        finally:
            self.stop()
        assert self.proc.returncode == 0, err[-3000:]
        report: dict[str, Any] = json.loads(out)
        for call in report["calls"]:
            result = call.get("result") or {}
            data = result.get("structuredContent") or {}
            if isinstance(data.get("sandbox_id"), str):
                self.server.sandbox_ids.add(data["sandbox_id"])
        return report

    def stop(self) -> None:
        """Kill the client if it still runs (its server then reads EOF and cleans up)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def ts_client(tmp_path: Path, server: Server, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Run tests/mcp_clients/ts_client.mjs against a fresh server; its JSON report."""
    return TsClient(tmp_path, server, calls).report()


# Started by tests/conftest.py as soon as the session's tests are collected, when they
# include the long-call test: its 90 s of waiting then overlap the rest of the suite.
long_call: tuple[Server, TsClient] | None = None


def start_long_call(tmp_path: Path) -> tuple[Server, TsClient]:
    server = Server(tmp_path, config={"mcp": {"timeoutS": LONG_CALL_S + 60}})
    seconds = int(LONG_CALL_S)
    command = f"i=0; while [ $i -lt {seconds} ]; do echo tick $i; sleep 1; i=$((i+1)); done"
    calls = [{"name": "run_shell_monitored", "arguments": {"command": command}, "progress": True}]
    return server, TsClient(tmp_path, server, calls)


def ts_text(call: dict[str, Any]) -> str:
    """Our first text block of an error result the TypeScript client returned (not threw)."""
    assert call["ok"], call.get("error")
    result = call["result"]
    assert result["isError"] is True, result
    assert "structuredContent" not in result, result
    return str(result["content"][0]["text"])


@pytest.mark.node
def test_the_typescript_client_shows_our_errors(tmp_path: Path) -> None:
    server = Server(tmp_path)
    report = ts_client(
        tmp_path,
        server,
        [
            {"name": BAD_ARGUMENTS[0], "arguments": BAD_ARGUMENTS[1]},
            {"name": UNKNOWN_SANDBOX[0], "arguments": UNKNOWN_SANDBOX[1]},
            {"name": "sandbox_destroy", "arguments": {"sandbox_id": NEVER}},
            {"name": "sandbox_create", "arguments": {}},
            {"name": "sandbox_destroy", "arguments": {"sandbox_id": "$sandbox_id"}},
            {"name": "sandbox_destroy", "arguments": {"sandbox_id": "$sandbox_id"}},
            {"name": "sandbox_exec", "arguments": {"sandbox_id": "$sandbox_id", "command": "ls"}},
            {"name": "run_shell_monitored", "arguments": {"command": "printf 'h\\351\\n'"}},
        ],
    )
    calls = report["calls"]
    assert ts_text(calls[0]) == BAD_ARGUMENTS[2]
    assert ts_text(calls[1]) == UNKNOWN_SANDBOX[2]
    assert ts_text(calls[2]) == f"no such sandbox: '{NEVER}'"
    created = calls[3]["result"]["structuredContent"]
    sid = created["sandbox_id"]
    assert calls[4]["result"]["structuredContent"] == {"sandbox_id": sid, "destroyed": True}
    assert ts_text(calls[5]) == f"no such sandbox: '{sid}' (destroyed by sandbox_destroy)"
    assert ts_text(calls[6]) == f"no such sandbox: '{sid}' (destroyed by sandbox_destroy)"
    # A success of a run tool: one JSON text block, the output once, flagged binary.
    (block,) = calls[7]["result"]["content"]
    data = json.loads(block["text"])
    assert set(data) == SHELL_OUTPUT_KEYS and data["stdout_binary"] is True
    assert data["stdout"] == "h\ufffd\n" and data["stdout_bytes"] == 3
    server.assert_nothing_left()


def inspector(server: Server, tool: str, arguments: dict[str, Any]) -> subprocess.CompletedProcess:
    """One ``mcp-inspector --cli`` tools/call against a fresh stdio server."""
    args = ["--method", "tools/call", "--tool-name", tool]
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value)
        args += ["--tool-arg", f"{key}={text}"]
    binary = CLIENTS / "node_modules" / ".bin" / "mcp-inspector"
    return subprocess.run(
        [str(binary), "--cli", sys.executable, *server.args, *args],
        cwd=server.db.parent,
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT_S,
        check=False,
    )


@pytest.mark.node
def test_the_inspector_cli_shows_our_errors(tmp_path: Path) -> None:
    """Each Inspector run is a new server (and a new client), so "a second destroy" is a
    destroy of an id that server never had: the same message as an unknown sandbox."""
    server = Server(tmp_path)
    for tool, arguments, message in (
        BAD_ARGUMENTS,
        UNKNOWN_SANDBOX,
        ("sandbox_destroy", {"sandbox_id": NEVER}, f"no such sandbox: '{NEVER}'"),
    ):
        done = inspector(server, tool, arguments)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "does not match the tool's output schema" not in done.stdout + done.stderr
        result = json.loads(done.stdout)
        assert result["isError"] is True and "structuredContent" not in result
        assert result["content"][0]["text"] == message
    done = inspector(server, "sandbox_create", {})
    assert done.returncode == 0, done.stdout + done.stderr
    server.sandbox_ids.add(json.loads(done.stdout)["structuredContent"]["sandbox_id"])
    server.assert_nothing_left()


def test_the_python_client_shows_our_errors(tmp_path: Path) -> None:
    server = Server(tmp_path)

    async def scenario(client: Client) -> None:
        await client.list_tools()
        for tool, arguments, message in (BAD_ARGUMENTS, UNKNOWN_SANDBOX):
            r = await server.call(client, tool, arguments)
            assert error_text(r) == message
            assert tool_answer(r)["error"] in {"invalid_arguments", "sandbox_not_found"}
        r = await server.call(client, "sandbox_create", {})
        sid = tool_answer(r)["sandbox_id"]
        assert not (await server.call(client, "sandbox_destroy", {"sandbox_id": sid})).is_error
        again = await server.call(client, "sandbox_destroy", {"sandbox_id": sid})
        assert error_text(again) == f"no such sandbox: '{sid}' (destroyed by sandbox_destroy)"
        assert tool_answer(again) == {
            "error": "sandbox_not_found",
            "sandbox_id": sid,
            "detail": "destroyed by sandbox_destroy",
        }

    server.run(scenario)
    server.assert_nothing_left()


@pytest.mark.node
@pytest.mark.slow
def test_a_call_longer_than_the_typescript_timeout_completes_on_progress(
    tmp_path: Path,
) -> None:
    """A ``LONG_CALL_S`` call (90 s) in the TypeScript client with its default 60 s request
    timeout: it completes because the server reports progress and the client resets its
    timeout on each notification, as hosts configure it. (Started in the background when
    the session's tests were collected; started here when run on its own.)"""
    server, client = long_call if long_call is not None else start_long_call(tmp_path)
    seconds = int(LONG_CALL_S)
    report = client.report()
    (call,) = report["calls"]
    assert call["ok"], call.get("error")
    data = json.loads(call["result"]["content"][0]["text"])
    assert data["exit_code"] == 0 and data["stdout"].startswith("tick 0\n")
    assert call["elapsedMs"] >= seconds * 1000  # past the client's 60 s, at 90 s
    progress = call["progress"]
    # A steady interval: about one every 5 s, the values growing, the output counted.
    assert len(progress) >= seconds // 5 - 2, progress
    values = [p["progress"] for p in progress]
    assert values == sorted(values) and len(set(values)) == len(values)
    gaps = [b["atMs"] - a["atMs"] for a, b in itertools.pairwise(progress)]
    assert max(gaps) < 30_000, gaps  # never near the client's 60 s
    assert "bytes of stdout" in progress[-1]["message"]
    assert int(progress[-1]["message"].split(";")[1].split()[0]) > 0  # output so far
    assert re.search(r"; last line \(stdout\): tick \d+$", progress[-1]["message"])
    server.assert_nothing_left()


def test_progress_reaches_the_python_client(tmp_path: Path) -> None:
    """Without a progress token nothing is sent; with one, notifications come while the
    command runs (the interval is the server's: 5 s)."""
    server = Server(tmp_path)
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async def scenario(client: Client) -> None:
        r = await client.call_tool(
            "run_shell_monitored",
            {"command": "echo start; sleep 12; echo end"},
            read_timeout_seconds=CALL_TIMEOUT_S,
            progress_callback=on_progress,
        )
        assert tool_answer(r)["stdout"] == "start\nend\n"
        assert len(seen) >= 2 and seen[0][0] < seen[1][0] and seen[0][1] is None
        assert "6 bytes of stdout" in str(seen[-1][2])
        assert str(seen[-1][2]).endswith("; last line (stdout): start")
        count = len(seen)
        r = await client.call_tool(
            "run_shell_monitored", {"command": "sleep 6"}, read_timeout_seconds=CALL_TIMEOUT_S
        )
        assert not r.is_error and len(seen) == count

    server.run(scenario)
    server.assert_nothing_left()


@pytest.mark.node
def test_the_typescript_client_takes_run_code_images(tmp_path: Path) -> None:
    """A run_code answer with image content (and a kill's error with it) is accepted by the
    TypeScript client's result validation, and the images arrive as MCP ImageContent."""
    from tests.integration.test_run_code_images import PROGRAM, RETURNED

    server = Server(tmp_path)
    report = ts_client(
        tmp_path,
        server,
        [{"name": "run_code", "arguments": {"language": "python", "code": PROGRAM}}],
    )
    (call,) = report["calls"]
    assert call["ok"], call.get("error")
    result = call["result"]
    assert not result.get("isError") and "structuredContent" not in result
    text, *images = result["content"]
    data = json.loads(text["text"])
    assert data["exit_code"] == 3
    assert {i["name"]: i["mime_type"] for i in data["images"]} == RETURNED
    assert [b["type"] for b in images] == ["image", "image"]
    assert [b["mimeType"] for b in images] == [i["mime_type"] for i in data["images"]]
    server.assert_nothing_left()

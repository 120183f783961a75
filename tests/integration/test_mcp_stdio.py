"""The real ``devs-sandbox mcp`` process, driven by the MCP SDK's own client.

Over stdio (as an MCP client launches it): tools and schemas, a normal call, a CPU kill,
an RSS kill, a multi-step session, bad inputs, and shutdown (stdin EOF, SIGTERM) with
no sandbox process, workspace, cgroup or lease left behind. One test over streamable
HTTP. Every server gets its own violation store; leftovers are checked by the ids the
server handed out and by the leases its pid owned.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

pytest.importorskip("mcp")

from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult

from devs_sandbox.leases import LeaseRegistry
from tests.conftest import caps
from tests.contracts import SHELL_OUTPUT_KEYS, tool_answer
from tests.integration.helpers import processes_with, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.mcp]
PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
CALL_TIMEOUT_S = 120  # generous: another test session may be loading this host


def marker() -> str:
    return f"devs-test-{uuid.uuid4().hex[:12]}"


def bg(tag: str, seconds: int = 300) -> str:
    return f"bash -c 'exec -a {tag} sleep {seconds}'"


class Server:
    """Parameters for one ``python -m devs_sandbox mcp`` with its own store and config."""

    def __init__(self, tmp_path: Path, config: dict[str, Any] | None = None) -> None:
        self.db = tmp_path / f"mcp-{uuid.uuid4().hex[:8]}.db"
        self.args = ["-m", "devs_sandbox", "mcp", "--db", str(self.db)]
        if config is not None:
            path = tmp_path / "devs.config.json"
            path.write_text(json.dumps(config))
            self.args += ["--config", str(path)]
        self.params = StdioServerParameters(
            command=sys.executable, args=self.args, env=dict(os.environ), cwd=str(tmp_path)
        )
        self.pids: set[int] = set()
        self.sandbox_ids: set[str] = set()

    def run(self, scenario: Callable[[Client], Awaitable[None]]) -> None:
        async def main() -> None:
            with anyio.fail_after(300):
                async with Client(self.params) as client:
                    self.pids |= {p.pid for p in self.processes()}
                    await scenario(client)

        anyio.run(main)

    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if str(self.db) in p.cmdline():
                    found.append(p)
        return found

    async def call(self, client: Client, tool: str, args: dict[str, Any]) -> CallToolResult:
        r = await client.call_tool(tool, args, read_timeout_seconds=CALL_TIMEOUT_S)
        data = tool_answer(r) or {}
        if isinstance(data, dict) and isinstance(data.get("sandbox_id"), str):
            self.sandbox_ids.add(data["sandbox_id"])
        return r

    def assert_nothing_left(self) -> None:
        """The server exited and took every sandbox with it."""
        assert wait_for(lambda: not self.processes(), 15), "the server process outlived its client"
        for row in self.violation_rows():
            self.sandbox_ids.add(row["sandbox_id"])
        leases = list(LeaseRegistry().directory.glob("*.json"))
        owned = [
            lease
            for lease in leases
            if _lease_owner(lease) in self.pids or lease.stem in self.sandbox_ids
        ]
        assert not owned, f"leases left: {owned}"
        for sandbox_id in self.sandbox_ids:
            assert not Path(f"/tmp/devs-sandbox-{sandbox_id}").exists()
            assert not list(Path("/sys/fs/cgroup").glob(f"*/devs-sandbox/{sandbox_id}"))
            assert not list(Path("/sys/fs/cgroup").glob(f"devs-sandbox/{sandbox_id}"))

    def violation_rows(self) -> list[dict[str, Any]]:
        if not self.db.exists():
            return []
        from devs_sandbox.store import ViolationStore

        with ViolationStore(self.db) as store:
            return store.list()


def _lease_owner(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["owner"]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def error_text(r: CallToolResult) -> str:
    assert r.is_error, r
    return str(getattr(r.content[0], "text", ""))


# -- tests ------------------------------------------------------------------------------------
def test_tools_and_schemas(tmp_path: Path) -> None:
    server = Server(tmp_path, config={"mcp": {"rssLimitBytes": 1 << 30, "timeoutS": 60}})

    async def scenario(client: Client) -> None:
        assert client.server_info is not None and client.server_info.name == "devs-sandbox"
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert sorted(tools) == [
            "run_shell_monitored",
            "sandbox_create",
            "sandbox_destroy",
            "sandbox_exec",
            "sandbox_list_files",
            "sandbox_read_file",
            "sandbox_violations",
            "sandbox_write_file",
        ]
        schema = tools["run_shell_monitored"].input_schema
        assert schema["required"] == ["command"]
        assert schema["properties"]["command"]["type"] == "string"
        assert schema["properties"]["rss_limit_bytes"]["default"] == 1 << 30
        assert schema["properties"]["timeout_s"]["default"] == 60
        assert schema["properties"]["cpu_sustained_ms"]["default"] == 10_000
        assert schema["properties"]["poll_interval_ms"]["default"] == 1_000
        assert tools["sandbox_exec"].input_schema["required"] == ["sandbox_id", "command"]
        assert tools["sandbox_destroy"].input_schema["required"] == ["sandbox_id"]
        # The run tools answer in one JSON text block (SHELL_OUTPUT_KEYS), no output schema.
        assert tools["run_shell_monitored"].output_schema is None
        assert schema["properties"]["max_output_bytes"]["default"] == 64 << 10

    server.run(scenario)
    server.assert_nothing_left()


def test_a_normal_call_and_bad_inputs(tmp_path: Path) -> None:
    server = Server(tmp_path)

    async def scenario(client: Client) -> None:
        r = await server.call(
            client, "run_shell_monitored", {"command": "echo hello; id -u; echo oops >&2; exit 4"}
        )
        assert not r.is_error, r
        data = tool_answer(r)
        assert data is not None
        out_lines = data["stdout"].splitlines()
        assert (data["exit_code"], out_lines[0], data["stderr"]) == (4, "hello", "oops\n")
        if os.geteuid() == 0:  # as root, the sandbox has a uid of its own, never root's
            assert int(out_lines[1]) >= 1_600_000_000
        assert data["stdout_truncated"] is False and data["duration_s"] > 0
        assert set(data) == SHELL_OUTPUT_KEYS

        bad: list[tuple[str, dict[str, Any], str]] = [
            ("run_shell_monitored", {"command": ""}, "command: String should have at least 1"),
            ("run_shell_monitored", {"command": " "}, "command: must not be empty"),
            ("run_shell_monitored", {"command": 7}, "command: Input should be a valid string"),
            ("run_shell_monitored", {}, "command: Field required"),
            (
                "run_shell_monitored",
                {"command": "ls", "rss_limit_bytes": -5},
                "rss_limit_bytes: Input should be greater than or equal to 1048576",
            ),
            (
                "run_shell_monitored",
                {"command": "ls", "cpu_sustained_ms": "10s"},
                "cpu_sustained_ms: Input should be a valid integer",
            ),
            (
                "run_shell_monitored",
                {"command": "ls", "timeout_s": -1},
                "timeout_s: Input should be greater than 0",
            ),
            (
                "sandbox_exec",
                {"sandbox_id": "sb-000000000000", "command": "ls"},
                "no such sandbox: 'sb-000000000000'",
            ),
            ("sandbox_destroy", {"sandbox_id": "sb-000000000000"}, "no such sandbox"),
            ("sandbox_destroy", {"sandbox_id": 12}, "sandbox_id: Input should be a valid string"),
            ("sandbox_violations", {"limit": -1}, "limit: Input should be greater than or equal"),
            ("no_such_tool", {}, "unknown tool 'no_such_tool'"),
        ]
        for tool, args, expect in bad:
            r = await server.call(client, tool, args)
            text = error_text(r)
            assert expect in text, (tool, args, text)
            assert "Traceback" not in text
        # A second destroy.
        r = await server.call(client, "sandbox_create", {})
        assert tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        assert not (await server.call(client, "sandbox_destroy", {"sandbox_id": sid})).is_error
        again = await server.call(client, "sandbox_destroy", {"sandbox_id": sid})
        assert "(destroyed by sandbox_destroy)" in error_text(again)
        # Still serving after all that.
        r = await server.call(client, "run_shell_monitored", {"command": "echo alive"})
        assert tool_answer(r) is not None and tool_answer(r)["stdout"] == "alive\n"

    server.run(scenario)
    server.assert_nothing_left()


def test_a_cpu_kill_and_an_rss_kill(tmp_path: Path) -> None:
    server = Server(tmp_path)

    async def scenario(client: Client) -> None:
        # Four busy loops (two forks): busy even on a host another test session loads.
        spin = f"{PY} -c \"import os; os.fork(); os.fork(); exec('while True: pass')\""
        r = await server.call(
            client,
            "run_shell_monitored",
            {"command": spin, "cpu_sustained_ms": 1_000, "poll_interval_ms": 250},
        )
        assert error_text(r).startswith("Process ")
        cpu = tool_answer(r)
        assert cpu is not None and cpu["reason"] == "cpu"
        assert cpu["value"] >= cpu["limit"] == 97.0  # a 1 s window: two 10 ms ticks and 1%
        assert isinstance(cpu["pid"], int) and cpu["exit_code"] == 137

        tag = marker()
        hog = f"{bg(tag)} & {PY} -c \"import time; x = b'x' * (160 << 20); time.sleep(120)\""
        r = await server.call(
            client,
            "run_shell_monitored",
            {"command": hog, "rss_limit_bytes": 64 << 20, "poll_interval_ms": 100},
        )
        rss = tool_answer(r)
        assert rss is not None and rss["reason"] == "rss"
        assert rss["value"] > rss["limit"] == 64 << 20
        assert f"exceeded rss limit: {rss['value']} > {64 << 20}" in error_text(r)
        assert not processes_with(tag)

        r = await server.call(client, "sandbox_violations", {"limit": 10})
        assert tool_answer(r) is not None
        kinds = [v["violation_type"] for v in tool_answer(r)["violations"]]
        assert kinds == ["MEMORY_EXCEEDED", "CPU_EXCEEDED"]

    server.run(scenario)
    server.assert_nothing_left()


@pytest.mark.cgroups
def test_a_kernel_oom_kill_in_a_session_is_reported_by_the_call_that_caused_it(
    tmp_path: Path,
) -> None:
    """The memory cgroup OOM-kills the command (the RSS monitor's limit is far above): that
    call says the quota was broken and the sandbox destroyed; before the fix it read as a
    plain exit 137, and the next command (an echo) was the one reported as the violation."""
    server = Server(tmp_path)
    hog = f"{PY} -c \"x = b'x' * (400 << 20)\""

    async def scenario(client: Client) -> None:
        r = await server.call(client, "sandbox_create", {"quotas": {"memory_bytes": 96 << 20}})
        sid = tool_answer(r)["sandbox_id"]
        r = await server.call(client, "sandbox_exec", {"sandbox_id": sid, "command": "echo ok"})
        assert tool_answer(r)["stdout"] == "ok\n"
        r = await server.call(client, "sandbox_exec", {"sandbox_id": sid, "command": hog})
        text = error_text(r)
        assert text.startswith("sandbox quota exceeded: MEMORY_EXCEEDED"), text
        assert "the sandbox destroyed" in text
        assert tool_answer(r)["exit_code"] == 137
        r = await server.call(client, "sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert error_text(r) == f"no such sandbox: '{sid}' (terminated for MEMORY_EXCEEDED)"
        r = await server.call(client, "sandbox_destroy", {"sandbox_id": sid})
        assert error_text(r) == f"no such sandbox: '{sid}' (terminated for MEMORY_EXCEEDED)"

    server.run(scenario)
    server.assert_nothing_left()


def test_a_multi_step_session_then_stdin_eof_destroys_everything(tmp_path: Path) -> None:
    server = Server(tmp_path)
    tag = marker()

    async def scenario(client: Client) -> None:
        r = await server.call(client, "sandbox_create", {"quotas": {"memory_bytes": 512 << 20}})
        assert not r.is_error, r
        created = tool_answer(r)
        assert created is not None
        sid = created["sandbox_id"]
        if not caps()["bwrap"]:  # a host without it runs the session with fewer layers
            assert "pid-namespace" in created["isolation"]
        r = await server.call(
            client, "sandbox_exec", {"sandbox_id": sid, "command": "echo step one > notes.txt; pwd"}
        )
        assert tool_answer(r) is not None
        assert tool_answer(r)["stdout"] == created["workspace"] + "\n"
        r = await server.call(
            client,
            "sandbox_exec",
            {"sandbox_id": sid, "command": "echo two >> notes.txt; cat notes.txt"},
        )
        assert tool_answer(r) is not None
        assert tool_answer(r)["stdout"] == "step one\ntwo\n"
        assert Path(created["workspace"]).is_dir()
        # A second session left open and a call still running when the client goes away.
        r = await server.call(client, "sandbox_create", {})
        assert tool_answer(r) is not None
        other = tool_answer(r)["sandbox_id"]

        async with anyio.create_task_group() as tg:
            tg.start_soon(
                server.call, client, "sandbox_exec", {"sandbox_id": other, "command": bg(tag)}
            )
            tg.start_soon(server.call, client, "run_shell_monitored", {"command": bg(tag)})
            with anyio.fail_after(60):
                while len(processes_with(tag)) < 2:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()  # ... and the client closes the server's stdin

    server.run(scenario)
    assert wait_for(lambda: not processes_with(tag), 15)
    server.assert_nothing_left()


def _rpc(
    proc: subprocess.Popen[bytes], message: dict[str, Any], *, wait: bool = True
) -> dict[str, Any] | None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(message) + "\n").encode())
    proc.stdin.flush()
    if "id" not in message or not wait:
        return None
    while True:
        reply = json.loads(proc.stdout.readline())
        if reply.get("id") == message["id"]:
            return dict(reply)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_destroys_everything_even_with_stdin_open(tmp_path: Path, signum: int) -> None:
    """A supervisor's SIGTERM (or a Ctrl-C) without closing stdin: the sandboxes go first."""
    server = Server(tmp_path)
    tag = marker()
    proc = subprocess.Popen(
        [sys.executable, *server.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        hello = {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        }
        assert _rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello})
        _rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        reply = _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "sandbox_create", "arguments": {}},
            },
        )
        assert reply is not None
        sid = reply["result"]["structuredContent"]["sandbox_id"]
        server.sandbox_ids.add(sid)
        server.pids.add(proc.pid)
        call = {"sandbox_id": sid, "command": bg(tag)}
        _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "tools/call",
                "params": {"name": "sandbox_exec", "arguments": call},
            },
            wait=False,
        )
        assert wait_for(lambda: processes_with(tag), 30)
        proc.send_signal(signum)
        assert proc.wait(30) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert not processes_with(tag)
    server.assert_nothing_left()


def test_a_forgotten_session_is_reaped(tmp_path: Path) -> None:
    server = Server(tmp_path, config={"mcp": {"sessionIdleTimeoutS": 1}})

    async def scenario(client: Client) -> None:
        r = await server.call(client, "sandbox_create", {})
        assert tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        workspace = Path(tool_answer(r)["workspace"])
        with anyio.fail_after(30):
            while workspace.exists():
                await anyio.sleep(0.1)
        r = await server.call(client, "sandbox_exec", {"sandbox_id": sid, "command": "ls"})
        assert "1 s without a call (mcp.sessionIdleTimeoutS)" in error_text(r)

    server.run(scenario)
    server.assert_nothing_left()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_streamable_http(tmp_path: Path) -> None:
    server = Server(tmp_path)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, *server.args, "--http", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server.pids.add(proc.pid)
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline().decode()
        assert f"http://127.0.0.1:{port}/mcp" in banner

        async def main() -> None:
            with anyio.fail_after(120):
                async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                    names = {t.name for t in (await client.list_tools()).tools}
                    assert "run_shell_monitored" in names
                    r = await server.call(
                        client, "run_shell_monitored", {"command": "echo over http"}
                    )
                    assert tool_answer(r) is not None
                    assert tool_answer(r)["stdout"] == "over http\n"
                    r = await server.call(client, "sandbox_create", {})
                    assert not r.is_error

        assert wait_for(lambda: _accepts(port), 30)  # bound a moment after the banner
        anyio.run(main)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    server.assert_nothing_left()


def test_files_of_a_session_sandbox(tmp_path: Path) -> None:
    """Write, run, read back (text and bytes), list; paths out of the workspace refused."""
    server = Server(tmp_path)

    async def scenario(client: Client) -> None:
        sid = tool_answer(await server.call(client, "sandbox_create", {}))["sandbox_id"]
        script = "#!/bin/sh\nprintf '\\377\\000' > bytes.bin; echo ran > out.txt\n"
        w = await server.call(
            client,
            "sandbox_write_file",
            {"sandbox_id": sid, "path": "bin/run.sh", "content": script, "executable": True},
        )
        assert tool_answer(w) == {
            "sandbox_id": sid,
            "path": "bin/run.sh",
            "size_bytes": len(script),
        }
        r = await server.call(client, "sandbox_exec", {"sandbox_id": sid, "command": "bin/run.sh"})
        assert tool_answer(r)["exit_code"] == 0
        text = tool_answer(
            await server.call(client, "sandbox_read_file", {"sandbox_id": sid, "path": "out.txt"})
        )
        assert (text["content"], text["encoding"]) == ("ran\n", "text")
        raw = tool_answer(
            await server.call(client, "sandbox_read_file", {"sandbox_id": sid, "path": "bytes.bin"})
        )
        assert raw["encoding"] == "base64" and raw["content"] == "/wA="  # never mangled
        listing = tool_answer(await server.call(client, "sandbox_list_files", {"sandbox_id": sid}))
        assert {e["name"] for e in listing["entries"]} == {"bin", "bytes.bin", "out.txt"}
        await server.call(
            client, "sandbox_exec", {"sandbox_id": sid, "command": "ln -s /etc/passwd pw"}
        )
        for path, expect in (
            ("pw", "outside the workspace"),
            ("../etc/passwd", "inside the workspace"),
            ("/etc/passwd", "inside the workspace"),
        ):
            bad = await server.call(client, "sandbox_read_file", {"sandbox_id": sid, "path": path})
            assert expect in error_text(bad), path
        nobody = await server.call(
            client, "sandbox_read_file", {"sandbox_id": "sb-nobody", "path": "out.txt"}
        )
        assert "sb-nobody" in error_text(nobody)

    server.run(scenario)
    server.assert_nothing_left()

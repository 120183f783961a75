"""The MCP tools in process, through the SDK's own client over its in-memory transport,
with FakeDriver, a scripted stats source and a manual clock: schemas, results, tool
errors for every kind of bad input, sessions. The real server process is tested in
tests/integration/test_mcp_stdio.py."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from mcp import Client
from mcp.types import CallToolResult

from devs_sandbox.config import DevsConfig, SandboxLifecycleConfig, parse_config
from devs_sandbox.drivers.fake import FakeDriver, FakeSandbox, killed_result, ok_result
from devs_sandbox.errors import ConfigError
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.sampling import ScriptedProcessStats
from devs_sandbox.lifecycle.timeout import SandboxTimeoutEnforcer
from devs_sandbox.mcp_server import LOCAL_CALLER, Caller, DevsMcpServer
from devs_sandbox.models import (
    DetectionRule,
    ExecResult,
    SandboxMetrics,
    TreeSample,
    Violation,
    ViolationType,
)
from devs_sandbox.scheduler import FakeScheduler
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.sessions import SandboxSessions
from tests.contracts import SHELL_OUTPUT_KEYS, tool_answer

pytestmark = [pytest.mark.unit, pytest.mark.mcp]
PID = 31337
PRIME = TreeSample(rss_bytes=1 << 20, cpu_percent=None)
OUTPUT_KEYS = SHELL_OUTPUT_KEYS


class PidDriver(FakeDriver):
    def provision(self, config: SandboxLifecycleConfig, **kw: Any) -> Any:
        ctx = super().provision(config, **kw)
        self.sandboxes[ctx.id].pid = PID
        return ctx


class Harness:
    """A DevsMcpServer over FakeDriver; ``script`` is what every command's tree looks like."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        config: DevsConfig | None = None,
        script: Sequence[TreeSample | None] = (PRIME,),
        seconds: int = 3,
        driver: type[PidDriver] | None = None,
    ) -> None:
        self.sched = FakeScheduler()
        self.script = list(script)
        self.driver = (driver or PidDriver)(exec_handler=self._exec)
        self.seconds = seconds
        self.config = config or DevsConfig()
        self.manager = SandboxLifecycleManager(
            self.driver,
            config=self.config,
            store=ViolationStore(tmp_path / "v.db"),
            enforcer=SandboxTimeoutEnforcer(scheduler=self.sched),
        )
        self.sessions = SandboxSessions.from_config(self.manager, self.config.mcp, self.sched)
        self.app = DevsMcpServer(
            self.config,
            self.manager,
            self.sessions,
            stats_factory=lambda: ScriptedProcessStats(self.script),
            monitor_scheduler=self.sched,
        )

    def _exec(self, sb: FakeSandbox, cmd: Sequence[str]) -> ExecResult:
        text = cmd[-1]
        if text.startswith("echo "):
            return ok_result(text.removeprefix("echo ") + "\n")
        if text == "boom":
            raise RuntimeError("secret internal detail")
        if text == "false":
            return ok_result(exit_code=1, stderr="no\n")
        if text in {"silent", "slow"}:  # as the driver reports an idle or exec timeout
            r = ok_result("partial\n")
            return ExecResult(
                137,
                r.stdout,
                r.stderr,
                1.0,
                timed_out=text == "slow",
                idle_timed_out=text == "silent",
                signal=9,
            )
        for _ in range(self.seconds):  # anything else runs a while, killable
            if sb.stopped.is_set():
                return killed_result()
            self.sched.advance(1.0)
        return killed_result() if sb.stopped.is_set() else ok_result("done\n")

    def run(self, scenario: Callable[[Client], Awaitable[None]]) -> None:
        async def main() -> None:
            async with Client(self.app.server()) as client:
                await scenario(client)

        try:
            anyio.run(main)
        finally:
            self.sessions.close()
            self.manager.shutdown()

    def run_calls(self, scenario: Callable[[], Awaitable[None]]) -> None:
        """Call ``self.app.call`` directly, as callers of the tests' choosing."""
        try:
            anyio.run(scenario)
        finally:
            self.sessions.close()
            self.manager.shutdown()


def error_text(r: CallToolResult) -> str:
    assert r.is_error, r
    return str(getattr(r.content[0], "text", ""))


def test_tools_and_their_schemas(tmp_path: Path) -> None:
    config = parse_config(
        {"mcp": {"rssLimitBytes": 64 << 20, "cpuSustainedMs": 5_000, "timeoutS": 30}}
    )
    h = Harness(tmp_path, config=config)

    async def scenario(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {
            "run_shell_monitored",
            "sandbox_create",
            "sandbox_exec",
            "sandbox_destroy",
            "sandbox_violations",
            "sandbox_read_file",
            "sandbox_write_file",
            "sandbox_list_files",
        }
        for name in ("sandbox_read_file", "sandbox_write_file", "sandbox_list_files"):
            assert tools[name].input_schema["additionalProperties"] is False
            assert tools[name].output_schema is not None  # small answers: structured
        shell = tools["run_shell_monitored"].input_schema
        assert shell["type"] == "object" and shell["required"] == ["command"]
        assert shell["additionalProperties"] is False
        props = shell["properties"]
        assert set(props) == {
            "command",
            "timeout_s",
            "rss_limit_bytes",
            "cpu_sustained_ms",
            "poll_interval_ms",
            "max_output_bytes",
            "output_encoding",
        }
        assert props["command"]["type"] == "string"
        # Defaults come from devs.config.json's mcp section.
        assert props["rss_limit_bytes"]["default"] == 64 << 20
        assert props["cpu_sustained_ms"]["default"] == 5_000
        assert props["poll_interval_ms"]["default"] == 1_000
        assert props["timeout_s"]["default"] == 30
        assert props["rss_limit_bytes"]["minimum"] == 1 << 20
        # The run tools answer in one JSON text block (the output once), so they declare no
        # output schema; the small answers declare theirs.
        assert props["max_output_bytes"]["default"] == 64 << 10
        assert props["max_output_bytes"]["maximum"] == 1 << 20  # sandbox.maxOutputBytes
        assert props["output_encoding"]["enum"] == ["text", "base64"]
        assert tools["run_shell_monitored"].output_schema is None
        assert tools["sandbox_exec"].output_schema is None
        for name in ("sandbox_create", "sandbox_destroy", "sandbox_violations"):
            assert tools[name].output_schema is not None, name
        exec_props = tools["sandbox_exec"].input_schema["properties"]
        assert set(exec_props) == {*props, "sandbox_id"}
        for tool in tools.values():  # written out in full: no client has to resolve $ref
            assert "$ref" not in json.dumps(tool.input_schema)
            assert "$ref" not in json.dumps(tool.output_schema)
        assert tools["sandbox_violations"].annotations is not None
        assert tools["sandbox_violations"].annotations.read_only_hint is True

    h.run(scenario)


def test_a_normal_call_returns_the_structured_result(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("run_shell_monitored", {"command": "echo hello"})
        assert not r.is_error and r.structured_content is None
        assert tool_answer(r) == {
            "exit_code": 0,
            "stdout": "hello\n",
            "stderr": "",
            "stdout_truncated": False,
            "stderr_truncated": False,
            "stdout_bytes": 6,
            "stderr_bytes": 0,
            "stdout_binary": False,
            "stderr_binary": False,
            "encoding": "text",
            "duration_s": 0.0,
        }
        assert set(tool_answer(r)) == OUTPUT_KEYS

    h.run(scenario)
    assert len(h.driver.destroyed) == 1 and h.driver.sandboxes == {}


def test_a_kill_is_a_tool_error_carrying_pid_reason_value_limit(tmp_path: Path) -> None:
    h = Harness(tmp_path, script=[PRIME, TreeSample(rss_bytes=100 << 20, cpu_percent=5.0)])

    async def scenario(client: Client) -> None:
        r = await client.call_tool(
            "run_shell_monitored", {"command": "hog", "rss_limit_bytes": 50 << 20}
        )
        text = error_text(r)
        assert text.startswith(f"Process {PID} exceeded rss limit: {100 << 20} > {50 << 20}")
        assert "rss_limit_bytes" in text
        data = tool_answer(r)
        assert data is not None
        assert {k: data[k] for k in ("pid", "reason", "value", "limit")} == {
            "pid": PID,
            "reason": "rss",
            "value": 100 << 20,
            "limit": 50 << 20,
        }
        assert data["exit_code"] == 137  # what the command printed before, too
        rows = await client.call_tool("sandbox_violations", {})
        assert tool_answer(rows) is not None
        (row,) = tool_answer(rows)["violations"]
        assert row["violation_type"] == "MEMORY_EXCEEDED" and row["observed_value"] == 100 << 20

    h.run(scenario)


def test_a_cpu_kill(tmp_path: Path) -> None:
    h = Harness(tmp_path, script=[PRIME, TreeSample(rss_bytes=1 << 20, cpu_percent=199.0)])

    async def scenario(client: Client) -> None:
        r = await client.call_tool(
            "run_shell_monitored", {"command": "spin", "cpu_sustained_ms": 2_000}
        )
        assert error_text(r).startswith(
            f"Process {PID} exceeded cpu limit: 199.0 > 98.0"
        )  # the 2 s window's threshold
        assert tool_answer(r) is not None and tool_answer(r)["reason"] == "cpu"

    h.run(scenario)


def test_a_timeout_is_a_tool_error_with_the_output(tmp_path: Path) -> None:
    h = Harness(tmp_path, seconds=100)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("run_shell_monitored", {"command": "sleep 100", "timeout_s": 5})
        assert "timed out after 5 s" in error_text(r) and "timeout_s" in error_text(r)
        assert tool_answer(r) is not None
        assert tool_answer(r)["error"] == "timeout"
        assert tool_answer(r)["exit_code"] == 137

    h.run(scenario)


@pytest.mark.parametrize(
    ("arguments", "expect"),
    [
        ({}, "command: Field required"),
        ({"command": ""}, "command: String should have at least 1 character"),
        ({"command": "   "}, "command: must not be empty or only whitespace"),
        ({"command": 42}, "command: Input should be a valid string"),
        ({"command": ["ls"]}, "command: Input should be a valid string"),
        ({"command": "ls", "rss_limit_bytes": -1}, "rss_limit_bytes: Input should be greater"),
        ({"command": "ls", "rss_limit_bytes": "4GB"}, "rss_limit_bytes: Input should be a valid"),
        ({"command": "ls", "rss_limit_bytes": True}, "rss_limit_bytes: Input should be a valid"),
        ({"command": "ls", "cpu_sustained_ms": 0}, "cpu_sustained_ms: Input should be greater"),
        ({"command": "ls", "poll_interval_ms": 1.5}, "poll_interval_ms: Input should be a valid"),
        ({"command": "ls", "timeout_s": -2}, "timeout_s: Input should be greater than 0"),
        ({"command": "ls", "timeout_s": None}, "timeout_s: Input should be a valid number"),
        ({"command": "ls", "timeout": 5}, "timeout: unknown argument"),
    ],
)
def test_bad_input_is_a_clear_tool_error(
    tmp_path: Path, arguments: dict[str, Any], expect: str
) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("run_shell_monitored", arguments)
        text = error_text(r)
        assert text.startswith("invalid arguments for run_shell_monitored: ")
        assert expect in text
        assert "Traceback" not in text and "errors.pydantic.dev" not in text
        assert tool_answer(r) is not None
        assert tool_answer(r)["error"] == "invalid_arguments"
        # The server is still there.
        ok = await client.call_tool("run_shell_monitored", {"command": "echo still here"})
        assert not ok.is_error

    h.run(scenario)
    assert h.driver.provisioned == [h.driver.destroyed[0]]  # only the good call made a sandbox


def test_an_unknown_tool_and_an_internal_error(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("rm_rf", {})
        assert "unknown tool 'rm_rf'" in error_text(r)
        r = await client.call_tool("run_shell_monitored", {"command": "boom"})
        text = error_text(r)
        assert text.startswith("internal error in run_shell_monitored: RuntimeError")
        assert "secret internal detail" not in text  # the details stay in the server's log
        assert (
            await client.call_tool("run_shell_monitored", {"command": "echo ok"})
        ).is_error is False

    h.run(scenario)


def test_a_multi_step_session(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("sandbox_create", {})
        assert not r.is_error and tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        assert tool_answer(r)["expires_in_s"] == 3_600 and tool_answer(r)["isolation"]
        for word in ("one", "two"):
            r = await client.call_tool(
                "sandbox_exec", {"sandbox_id": sid, "command": f"echo {word}"}
            )
            assert tool_answer(r) is not None and tool_answer(r)["stdout"] == f"{word}\n"
        assert h.driver.sandboxes[sid].commands == [
            ["/bin/sh", "-c", "echo one"],
            ["/bin/sh", "-c", "echo two"],
        ]
        r = await client.call_tool("sandbox_destroy", {"sandbox_id": sid})
        assert tool_answer(r) == {"sandbox_id": sid, "destroyed": True}
        again = await client.call_tool("sandbox_destroy", {"sandbox_id": sid})
        assert f"no such sandbox: '{sid}' (destroyed by sandbox_destroy)" in error_text(again)
        assert tool_answer(again) is not None
        assert tool_answer(again)["error"] == "sandbox_not_found"
        gone = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert "no such sandbox" in error_text(gone)
        unknown = await client.call_tool("sandbox_exec", {"sandbox_id": "sb-nope", "command": "ls"})
        assert "no such sandbox: 'sb-nope'" in error_text(unknown)
        bad_id = await client.call_tool("sandbox_destroy", {"sandbox_id": "../etc"})
        assert "sandbox_id: String should match pattern" in error_text(bad_id)

    h.run(scenario)
    assert len(h.driver.destroyed) == 1


def test_a_kill_in_a_session_keeps_the_session(tmp_path: Path) -> None:
    h = Harness(tmp_path, script=[PRIME, TreeSample(rss_bytes=1 << 30, cpu_percent=1.0)])

    async def scenario(client: Client) -> None:
        r = await client.call_tool("sandbox_create", {})
        assert tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        r = await client.call_tool(
            "sandbox_exec", {"sandbox_id": sid, "command": "hog", "rss_limit_bytes": 1 << 29}
        )
        assert tool_answer(r) is not None and tool_answer(r)["reason"] == "rss"
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo alive"})
        assert tool_answer(r) is not None and tool_answer(r)["stdout"] == "alive\n"

    h.run(scenario)


def test_quotas_may_tighten_never_loosen(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        r = await client.call_tool(
            "sandbox_create", {"quotas": {"memory_bytes": 256 << 20, "cpu_cores": 0.5}}
        )
        assert not r.is_error and tool_answer(r) is not None
        sb = h.driver.sandboxes[tool_answer(r)["sandbox_id"]]
        assert sb.config.quotas.memory_bytes == 256 << 20 and sb.config.quotas.cpu_cores == 0.5
        r = await client.call_tool("sandbox_create", {"quotas": {"memory_bytes": 64 << 30}})
        assert "above this server's limit" in error_text(r)
        assert "sandbox.quotas.memoryBytes" in error_text(r)
        r = await client.call_tool("sandbox_create", {"quotas": {"memory_bytes": 1024}})
        assert "sandbox.quotas.memoryBytes" in error_text(r)  # below the config's minimum
        r = await client.call_tool("sandbox_create", {"quotas": {"swap": 1}})
        assert "quotas.swap: unknown argument" in error_text(r)

    h.run(scenario)
    assert len(h.driver.provisioned) == 1


def test_max_sessions_is_a_clear_tool_error(tmp_path: Path) -> None:
    h = Harness(tmp_path, config=parse_config({"mcp": {"maxSessions": 2}}))

    async def scenario(client: Client) -> None:
        ids = []
        for _ in range(2):
            r = await client.call_tool("sandbox_create", {})
            assert tool_answer(r) is not None
            ids.append(tool_answer(r)["sandbox_id"])
        r = await client.call_tool("sandbox_create", {})
        assert "too many sandboxes alive: 2 (mcp.maxSessions)" in error_text(r)
        r = await client.call_tool("run_shell_monitored", {"command": "echo x"})
        assert "too many sandboxes" in error_text(r)  # one-shot runs count too
        await client.call_tool("sandbox_destroy", {"sandbox_id": ids[0]})
        assert not (await client.call_tool("run_shell_monitored", {"command": "echo x"})).is_error

    h.run(scenario)


def test_violations_are_listed_newest_first_and_filtered(tmp_path: Path) -> None:
    h = Harness(tmp_path, script=[PRIME, TreeSample(rss_bytes=1 << 40, cpu_percent=None)])

    async def scenario(client: Client) -> None:
        for _ in range(3):
            await client.call_tool("run_shell_monitored", {"command": "hog"})
        rows = await client.call_tool("sandbox_violations", {"limit": 2})
        assert tool_answer(rows) is not None
        got = tool_answer(rows)["violations"]
        assert len(got) == 2 and got[0]["terminated_at"] >= got[1]["terminated_at"]
        one = await client.call_tool("sandbox_violations", {"sandbox_id": got[1]["sandbox_id"]})
        assert tool_answer(one) is not None
        assert [r["sandbox_id"] for r in tool_answer(one)["violations"]] == [got[1]["sandbox_id"]]
        bad = await client.call_tool("sandbox_violations", {"limit": 0})
        assert "limit: Input should be greater than or equal to 1" in error_text(bad)

    h.run(scenario)


def test_no_store_means_no_rows(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.manager.store = None

    async def scenario(client: Client) -> None:
        r = await client.call_tool("sandbox_violations", {})
        assert tool_answer(r) == {"violations": []}

    h.run(scenario)


def test_a_pinned_sandbox_id_in_the_config_is_not_reused(tmp_path: Path) -> None:
    h = Harness(tmp_path, config=parse_config({"sandbox": {"sandboxId": "fixed"}}))

    async def scenario(client: Client) -> None:
        for _ in range(2):
            assert not (
                await client.call_tool("run_shell_monitored", {"command": "echo x"})
            ).is_error

    h.run(scenario)
    assert "fixed" not in h.driver.provisioned and len(set(h.driver.provisioned)) == 2


def test_timeouts_quota_and_preflight_errors(tmp_path: Path) -> None:
    config = parse_config({"sandbox": {"idleTimeoutMs": 2_000}})
    h = Harness(tmp_path, config=config)

    async def scenario(client: Client) -> None:
        r = await client.call_tool("run_shell_monitored", {"command": "silent"})
        assert "printed nothing for 2 s" in error_text(r)
        assert "sandbox.idleTimeoutMs" in error_text(r)
        r = await client.call_tool("sandbox_create", {})
        assert tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        r = await client.call_tool(
            "sandbox_exec", {"sandbox_id": sid, "command": "slow", "timeout_s": 7}
        )
        assert "timed out after 7 s" in error_text(r)
        assert tool_answer(r) is not None and tool_answer(r)["stdout"] == "partial\n"
        v = Violation(sid, ViolationType.PROCESS_COUNT_EXCEEDED, 65, 64, DetectionRule.KERNEL)
        h.manager.detector.enforce_quota(v)
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert "PROCESS_COUNT_EXCEEDED (observed 65, limit 64)" in error_text(r)
        assert "the sandbox destroyed" in error_text(r)
        assert tool_answer(r) is not None
        assert tool_answer(r)["violation"]["type"] == "PROCESS_COUNT_EXCEEDED"
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert "terminated for PROCESS_COUNT_EXCEEDED" in error_text(r)
        r = await client.call_tool("run_shell_monitored", {"command": "a\u0000b"})
        assert "command: must not contain NUL bytes" in error_text(r)

    h.run(scenario)


def test_preflight_failures_and_a_closing_server(tmp_path: Path) -> None:
    h = Harness(tmp_path, config=parse_config({"sandbox": {"preflightCommands": ["false"]}}))

    async def scenario(client: Client) -> None:
        r = await client.call_tool("run_shell_monitored", {"command": "echo x"})
        assert "preflight command exited 1: false" in error_text(r)
        assert tool_answer(r) == {"error": "preflight_failed", "command": "false"}
        r = await client.call_tool("sandbox_create", {})
        assert "preflight command exited 1" in error_text(r)
        assert len(h.sessions) == 0  # the half-made session was destroyed
        h.sessions.close()
        r = await client.call_tool("sandbox_create", {})
        assert "shutting down" in error_text(r)
        assert tool_answer(r) == {"error": "sandbox_error", "type": "ServerClosingError"}

    h.run(scenario)
    assert len(h.driver.destroyed) == 2


def test_an_agent_cannot_ask_for_more_time_than_the_operator_allows(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"timeoutS \(600\) must not exceed maxTimeoutS \(60\)"):
        parse_config({"mcp": {"timeoutS": 600, "maxTimeoutS": 60}})
    h = Harness(tmp_path, config=parse_config({"mcp": {"timeoutS": 30, "maxTimeoutS": 60}}))

    async def scenario(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        for name in ("run_shell_monitored", "sandbox_exec"):
            assert tools[name].input_schema["properties"]["timeout_s"]["maximum"] == 60
        r = await client.call_tool("run_shell_monitored", {"command": "echo x", "timeout_s": 61})
        assert "timeout_s: Input should be less than or equal to 60" in error_text(r)

    h.run(scenario)


# -- tenancy (the transport side is tests/integration/test_mcp_http.py) -----------------------
ALICE = Caller("session-alice")
BOB = Caller("session-bob")


def test_a_caller_cannot_reach_another_callers_sandbox_nor_see_its_rows(tmp_path: Path) -> None:
    h = Harness(tmp_path, script=[PRIME, TreeSample(rss_bytes=1 << 40, cpu_percent=None)])

    async def scenario() -> None:
        r = await h.app.call("sandbox_create", {}, ALICE)
        assert tool_answer(r) is not None
        sid = tool_answer(r)["sandbox_id"]
        kill = {"sandbox_id": sid, "command": "hog"}
        assert (await h.app.call("sandbox_exec", kill, ALICE)).is_error  # a row for sid
        assert (await h.app.call("run_shell_monitored", {"command": "hog"}, ALICE)).is_error
        never = await h.app.call(
            "sandbox_exec", {"sandbox_id": "sb-000000000000", "command": "ls"}, BOB
        )
        for tool, args in (
            ("sandbox_exec", {"sandbox_id": sid, "command": "echo stolen"}),
            ("sandbox_destroy", {"sandbox_id": sid}),
        ):
            r = await h.app.call(tool, args, BOB)
            assert error_text(r) == error_text(never).replace("sb-000000000000", sid)
            assert tool_answer(r) == {
                "error": "sandbox_not_found",
                "sandbox_id": sid,
                "detail": "",
            }
        for args in ({}, {"sandbox_id": sid}):
            r = await h.app.call("sandbox_violations", args, BOB)
            assert tool_answer(r) == {"violations": []}
        assert (await h.app.call("run_shell_monitored", {"command": "hog"}, BOB)).is_error

        async def rows(caller: Caller) -> list[str]:
            r = await h.app.call("sandbox_violations", {}, caller)
            assert tool_answer(r) is not None
            return [v["sandbox_id"] for v in tool_answer(r)["violations"]]

        alices, bobs, everyone = await rows(ALICE), await rows(BOB), await rows(LOCAL_CALLER)
        assert len(alices) == 2 and sid in alices and len(bobs) == 1
        assert not set(alices) & set(bobs) and sorted(everyone) == sorted(alices + bobs)
        # Alice's sandbox is untouched and still hers.
        r = await h.app.call("sandbox_exec", {"sandbox_id": sid, "command": "echo mine"}, ALICE)
        assert tool_answer(r) is not None and tool_answer(r)["stdout"] == "mine\n"
        assert ["/bin/sh", "-c", "echo stolen"] not in h.driver.sandboxes[sid].commands
        # Her session ends: her sandbox goes, Bob's do not.
        r = await h.app.call("sandbox_create", {}, BOB)
        assert tool_answer(r) is not None
        bobs_sid = tool_answer(r)["sandbox_id"]
        await h.app._session_ended(ALICE.owner)
        assert sid in h.driver.destroyed and bobs_sid not in h.driver.destroyed
        r = await h.app.call("sandbox_create", {}, ALICE)
        assert tool_answer(r) == {"error": "sandbox_error", "type": "ServerClosingError"}

    h.run_calls(scenario)


def test_a_sessionless_caller_may_run_one_shot_commands_only(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    once = Caller("call-1", session=False)

    async def scenario() -> None:
        r = await h.app.call("run_shell_monitored", {"command": "echo hi"}, once)
        assert tool_answer(r) is not None and tool_answer(r)["stdout"] == "hi\n"
        for tool, args in (
            ("sandbox_create", {}),
            ("sandbox_exec", {"sandbox_id": "sb-000000000000", "command": "ls"}),
            ("sandbox_destroy", {"sandbox_id": "sb-000000000000"}),
            ("sandbox_violations", {}),
        ):
            r = await h.app.call(tool, args, once)
            assert f"{tool} needs an MCP session" in error_text(r), tool
            assert tool_answer(r) == {"error": "session_required"}
        assert h.sessions.owned_ids(once.owner) == []  # nothing kept for it

    h.run_calls(scenario)
    assert len(h.driver.provisioned) == 1


def test_max_sessions_per_client_is_a_clear_tool_error(tmp_path: Path) -> None:
    config = parse_config({"mcp": {"maxSessions": 3, "maxSessionsPerClient": 1}})
    h = Harness(tmp_path, config=config)

    async def scenario() -> None:
        assert not (await h.app.call("sandbox_create", {}, ALICE)).is_error
        r = await h.app.call("sandbox_create", {}, ALICE)
        assert "too many sandboxes for this client: 1 (mcp.maxSessionsPerClient)" in error_text(r)
        assert tool_answer(r) == {"error": "too_many_sandboxes", "limit": 1}
        assert not (await h.app.call("sandbox_create", {}, BOB)).is_error

    h.run_calls(scenario)


# -- session semantics (issue 13): a violation is reported by the call that caused it ---------
def test_a_kernel_oom_kill_is_reported_by_the_call_that_caused_it(tmp_path: Path) -> None:
    """The kernel OOM-kills the command between two polls: the call that ran it (exit 137)
    reports the quota and that the sandbox is gone, not the next call (even an echo)."""
    h = Harness(tmp_path)
    ran_oom: set[str] = set()
    fake_exec = h._exec

    def exec_(sb: FakeSandbox, cmd: Sequence[str]) -> ExecResult:
        if cmd[-1] == "oom":
            ran_oom.add(sb.ctx.id)
            return ExecResult(137, ok_result().stdout, ok_result().stderr, 0.5)
        return fake_exec(sb, cmd)

    h.driver.exec_handler = exec_
    h.driver._metrics_handler = lambda sb: SandboxMetrics(
        sb.ctx.id, time.monotonic(), oom_kills=1 if sb.ctx.id in ran_oom else 0
    )

    async def scenario(client: Client) -> None:
        sid = tool_answer(await client.call_tool("sandbox_create", {}))["sandbox_id"]
        ok = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo fine"})
        assert tool_answer(ok)["exit_code"] == 0
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "oom"})
        text = error_text(r)
        assert text.startswith("sandbox quota exceeded: MEMORY_EXCEEDED") and "destroyed" in text
        assert tool_answer(r)["violation"]["type"] == "MEMORY_EXCEEDED"
        assert tool_answer(r)["exit_code"] == 137
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert error_text(r) == f"no such sandbox: '{sid}' (terminated for MEMORY_EXCEEDED)"
        r = await client.call_tool("sandbox_destroy", {"sandbox_id": sid})
        assert error_text(r) == f"no such sandbox: '{sid}' (terminated for MEMORY_EXCEEDED)"

    h.run(scenario)
    assert h.driver.destroyed == [next(iter(ran_oom))]


class StopsWithItsCommand(PidDriver):
    """As a container whose init dies with the command: a kill takes the sandbox along."""

    def force_stop(self, ctx: Any) -> None:
        super().force_stop(ctx)
        with self._lock:
            self.sandboxes.pop(ctx.id, None)


def test_a_kill_that_stops_the_sandbox_says_so_on_that_call_and_after(tmp_path: Path) -> None:
    hog = TreeSample(rss_bytes=1 << 30, cpu_percent=1.0)
    h = Harness(tmp_path, script=[PRIME, hog], driver=StopsWithItsCommand)

    async def scenario(client: Client) -> None:
        sid = tool_answer(await client.call_tool("sandbox_create", {}))["sandbox_id"]
        r = await client.call_tool(
            "sandbox_exec", {"sandbox_id": sid, "command": "hog", "rss_limit_bytes": 1 << 29}
        )
        text = error_text(r)
        assert text.startswith(f"Process {PID} exceeded rss limit")
        why = "stopped when its command was killed for rss (the fake driver's kill reaches"
        assert f"; the sandbox is gone: {why}" in text
        assert tool_answer(r)["sandbox_gone"].startswith(why)
        for tool, args in (
            ("sandbox_exec", {"sandbox_id": sid, "command": "echo x"}),
            ("sandbox_destroy", {"sandbox_id": sid}),
        ):
            r = await client.call_tool(tool, args)
            assert error_text(r).startswith(f"no such sandbox: '{sid}' ({why}"), tool

    h.run(scenario)


def test_a_sandbox_lost_underneath_is_ended_and_said_so(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario(client: Client) -> None:
        sid = tool_answer(await client.call_tool("sandbox_create", {}))["sandbox_id"]
        with h.driver._lock:
            h.driver.sandboxes.pop(sid)  # its container died on its own
        lost = f"no such sandbox: '{sid}' (lost: the fake driver no longer has it)"
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo x"})
        assert error_text(r) == lost
        r = await client.call_tool("sandbox_destroy", {"sandbox_id": sid})
        assert error_text(r) == lost  # not "destroyed: true"

    h.run(scenario)

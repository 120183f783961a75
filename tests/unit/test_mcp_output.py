"""A run tool's output as the agent gets it: capped per call, head and tail, binary flagged
or base64 on request, and progress while it runs (mcp_server/output.py, progress.py)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from mcp import Client

from devs_sandbox.capture import TRUNCATION_MARKER
from devs_sandbox.drivers.fake import FakeDriver, FakeSandbox, ok_result
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.sampling import ScriptedProcessStats
from devs_sandbox.mcp_server import DevsMcpServer
from devs_sandbox.mcp_server.output import LINE_CHARS, CallOutput
from devs_sandbox.mcp_server.progress import ToolCall
from devs_sandbox.models import ExecResult, TreeSample
from devs_sandbox.tools.sessions import SandboxSessions
from tests.contracts import SHELL_OUTPUT_KEYS, tool_answer

pytestmark = [pytest.mark.unit, pytest.mark.mcp]


def fed(max_bytes: int, stdout: bytes, encoding: str = "text") -> dict[str, Any]:
    out = CallOutput(max_bytes, encoding)
    tap = out.tap()
    assert tap.max_output_bytes == max_bytes and tap.on_stdout is not None
    for i in range(0, len(stdout), 7):  # in chunks, as a pipe delivers them
        tap.on_stdout(stdout[i : i + 7])
    return out.fields()


def test_text_that_fits_is_sent_as_is() -> None:
    f = fed(64, "héllo\n".encode())
    assert f["stdout"] == "héllo\n" and f["stdout_bytes"] == 7
    assert f["stdout_truncated"] is False and f["stdout_binary"] is False
    assert f["stderr"] == "" and f["encoding"] == "text"


def test_head_and_tail_are_kept_and_the_gap_counted() -> None:
    data = b"".join(b"line %03d\n" % i for i in range(100))  # 900 bytes
    f = fed(100, data)
    assert f["stdout_truncated"] is True and f["stdout_bytes"] == 900
    head, tail = data[:50].decode(), data[-50:].decode()
    assert f["stdout"] == head + TRUNCATION_MARKER.format(dropped=800) + tail


def test_a_multibyte_character_split_by_the_cut_is_not_binary() -> None:
    data = "é".encode() * 100  # 200 bytes; an odd head cut splits one
    f = fed(65, data)
    assert f["stdout_truncated"] is True and f["stdout_binary"] is False


@pytest.mark.parametrize("data", [b"\xff\xfe\x00\x01", b"ok\x00ok", b"caf\xe9\n"])
def test_binary_is_flagged_in_text_and_exact_in_base64(data: bytes) -> None:
    f = fed(64, data)
    assert f["stdout_binary"] is True
    raw = fed(64, data, "base64")
    assert raw["encoding"] == "base64" and raw["stdout_binary"] is True
    assert base64.b64decode(raw["stdout"]) == data


def test_base64_of_a_truncated_stream_is_head_then_tail() -> None:
    data = bytes(range(256)) * 4
    raw = fed(100, data, "base64")
    kept = base64.b64decode(raw["stdout"])
    assert raw["stdout_truncated"] is True
    assert kept[:50] == data[:50] and kept[50:] == data[-50:]


def test_progress_quotes_the_latest_line_of_either_stream_as_a_terminal_shows_it() -> None:
    out = CallOutput(1 << 20)
    tap = out.tap()
    assert tap.on_stdout is not None and tap.on_stderr is not None
    assert "last line" not in out.progress_message(1)  # nothing written yet
    tap.on_stdout(b"step 1\nstep 2\npart")
    assert out.progress_message(2).endswith("; last line (stdout): step 2")
    tap.on_stderr(b"\x1b[31mwarning: \x1b]0;title\x07slow\x1b[0m\n\n \t\n")  # colours, blanks
    assert out.progress_message(3).endswith("; last line (stderr): warning: slow")
    tap.on_stdout(b"ial 3\n")  # the partial line, completed, and stdout wrote last
    assert out.progress_message(4).endswith("; last line (stdout): partial 3")
    tap.on_stdout(b" 10%\r 50%\r 90%\r\n")  # a progress bar: its latest state
    assert out.progress_message(5).endswith("; last line (stdout): 90%")
    tap.on_stdout(b"nul\x00byte\xff\n")
    assert out.progress_message(5).endswith("; last line (stdout): nul byte\ufffd")
    tap.on_stdout(b"x" * 100_000 + b"\n")  # one long line: cut, and read from its end only
    last = out.progress_message(6).rpartition("(stdout): ")[2]
    assert last == "x" * (LINE_CHARS - 1) + "\u2026"
    assert "bytes of stdout" in out.progress_message(6)


def test_with_progress_reports_on_an_interval_and_passes_errors_through() -> None:
    sent: list[tuple[float, str]] = []

    async def report(progress: float, message: str) -> None:
        sent.append((progress, message))

    call = ToolCall(report=report, interval_s=0.05)

    async def main() -> None:
        async def work() -> str:
            await anyio.sleep(0.3)
            return "done"

        assert await call.with_progress(work, lambda s: f"{s:.2f}") == "done"
        count = len(sent)
        assert count >= 3 and [p for p, _ in sent] == sorted(p for p, _ in sent)

        async def fails() -> None:
            await anyio.sleep(0.01)
            raise KeyError("mine")

        with pytest.raises(KeyError, match="mine"):  # itself, not an exception group
            await call.with_progress(fails, str)
        await anyio.sleep(0.2)
        assert len(sent) <= count + 1  # the ticker stopped with the work

    anyio.run(main)


def nap_or_flood(sb: FakeSandbox, cmd: list[str]) -> ExecResult:
    """``nap N`` takes N real seconds and prints as it goes; anything else prints 1000
    bytes at once. (FakeDriver hands the request's callbacks what a handler returns.)"""
    text = cmd[-1]
    if not text.startswith("nap "):
        return ok_result("x" * 1000)
    on_stdout = sb.requests[-1].on_stdout
    assert on_stdout is not None
    for _ in range(int(float(text.split()[1]) * 10)):
        on_stdout(b"tick\n")
        time.sleep(0.1)
    return ok_result()


def test_the_tools_send_progress_and_cap_output_in_process(tmp_path: Path) -> None:
    driver = FakeDriver(exec_handler=nap_or_flood)
    manager = SandboxLifecycleManager(driver)
    sessions = SandboxSessions.from_config(manager, manager.config.mcp)
    app = DevsMcpServer(
        manager.config,
        manager,
        sessions,
        stats_factory=lambda: ScriptedProcessStats(
            [TreeSample(rss_bytes=1 << 20, cpu_percent=None)]
        ),
        progress_interval_s=0.1,
    )
    seen: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, message))

    async def main() -> None:
        async with Client(app.server()) as client:
            r = await client.call_tool(
                "run_shell_monitored", {"command": "nap 0.6"}, progress_callback=on_progress
            )
            data = tool_answer(r)
            assert set(data) == SHELL_OUTPUT_KEYS and data["stdout"].startswith("tick\n")
            assert len(seen) >= 3 and "bytes of stdout" in str(seen[-1][1])
            assert str(seen[-1][1]).endswith("; last line (stdout): tick")
            r = await client.call_tool(
                "run_shell_monitored", {"command": "flood", "max_output_bytes": 100}
            )
            data = tool_answer(r)
            assert data["stdout_bytes"] == 1000 and data["stdout_truncated"] is True
            count = len(seen)
            await client.call_tool("run_shell_monitored", {"command": "nap 0.4"})
            assert len(seen) == count  # no progress asked, none sent
            assert len(data["stdout"]) < 200
            # The answer carries the output once: one text block, no structured copy.
            assert r.structured_content is None and len(r.content) == 1
            assert json.loads(r.content[0].text) == data  # type: ignore[union-attr]

    try:
        anyio.run(main)
    finally:
        sessions.close()
        manager.shutdown()

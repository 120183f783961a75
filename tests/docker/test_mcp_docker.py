"""The MCP session tools on the Docker driver (issue 13): a monitor kill that stops the
container ends the session on that call, and every later call, sandbox_destroy too, says
the sandbox is gone and why (it used to answer "no such sandbox" to sandbox_exec and
``destroyed: true`` to sandbox_destroy)."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("mcp")

from devs_sandbox.config import DevsConfig
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.mcp_server import DevsMcpServer
from devs_sandbox.tools.sessions import SandboxSessions
from tests.contracts import tool_answer

pytestmark = [pytest.mark.docker, pytest.mark.mcp]
HOG = "python3 -c \"import time; x = b'x' * (300 << 20); time.sleep(60)\""


def test_a_monitor_kill_that_stops_the_container_says_so(manager: SandboxLifecycleManager) -> None:
    config = DevsConfig.model_validate({"sandbox": {"driver": "docker"}})
    sessions = SandboxSessions.from_config(manager, config.mcp)
    app = DevsMcpServer(config, manager, sessions)

    async def scenario() -> None:
        sid = tool_answer(await app.call("sandbox_create", {}))["sandbox_id"]
        r = await app.call(
            "sandbox_exec",
            {"sandbox_id": sid, "command": HOG, "rss_limit_bytes": 100 << 20},
        )
        assert r.is_error
        text = str(getattr(r.content[0], "text", ""))
        assert text.startswith("Process ") and "exceeded rss limit" in text
        why = "stopped when its command was killed for rss (the docker driver's kill"
        assert f"the sandbox is gone: {why}" in text
        for tool, args in (
            ("sandbox_exec", {"sandbox_id": sid, "command": "echo x"}),
            ("sandbox_destroy", {"sandbox_id": sid}),
        ):
            r = await app.call(tool, args)
            assert r.is_error, tool
            assert str(getattr(r.content[0], "text", "")).startswith(
                f"no such sandbox: '{sid}' ({why}"
            )

    try:
        anyio.run(scenario)
    finally:
        sessions.close()

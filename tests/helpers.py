"""Builders every test group shares: one way to make a run config and a manager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from devs_sandbox.base import SandboxDriver
from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.store import ViolationStore


def config(**changes: Any) -> SandboxLifecycleConfig:
    """A run config from the defaults; ``quotas``/``isolation``/``docker`` dicts are merged."""
    return override(SandboxLifecycleConfig(), **changes)


def manager(
    driver: SandboxDriver | None = None, *, db: Path | None = None, **kw: Any
) -> SandboxLifecycleManager:
    """A lifecycle manager over ``driver`` (else the configured one), recording violations
    in ``db`` when given and nowhere otherwise (never the user's default store)."""
    return SandboxLifecycleManager(driver, store=ViolationStore(db) if db else None, **kw)


def background_pids() -> set[int]:
    """The processes of the long MCP call tests/conftest.py starts in the background (the
    node client and what it runs), which a check of "no children left" must not count."""
    import sys

    import psutil

    clients = sys.modules.get("tests.integration.test_mcp_clients")
    started = getattr(clients, "long_call", None)
    if started is None:
        return set()
    pid = started[1].proc.pid
    try:
        return {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {pid}


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (what a fresh process imports, not this one's):
    output captured as text, no stdin, the environment plus ``env``."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )

"""What every tool handler works with: the config, the manager, the session registry, and
the monitor's test seams. One object, built once by ``DevsMcpServer``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devs_sandbox.base import ProcessStatsSource, Scheduler
from devs_sandbox.config import DevsConfig, SandboxLifecycleConfig
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.tools.sessions import SandboxSessions
from devs_sandbox.tools.shell import MonitoredShellOptions


@dataclass(frozen=True)
class ToolEnv:
    """``sandbox_config`` is the config's sandbox section with no pinned id (every sandbox
    of ours gets a fresh one); ``stats_factory`` and ``monitor_scheduler`` are the
    monitor's test seams (a scripted stats source and a manual clock)."""

    config: DevsConfig
    manager: SandboxLifecycleManager
    sessions: SandboxSessions
    sandbox_config: SandboxLifecycleConfig
    multi_tenant: bool = False
    stats_factory: Callable[[], ProcessStatsSource] | None = None
    monitor_scheduler: Scheduler | None = None

    def options(self, args: Any) -> MonitoredShellOptions:
        """The monitor's options from a run tool's arguments."""
        return MonitoredShellOptions(
            rss_limit_bytes=args.rss_limit_bytes,
            cpu_sustained_ms=args.cpu_sustained_ms,
            poll_interval_ms=args.poll_interval_ms,
            timeout_s=args.timeout_s,
        )

    def stats(self) -> ProcessStatsSource | None:
        return self.stats_factory() if self.stats_factory is not None else None

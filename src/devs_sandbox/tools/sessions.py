"""Sandboxes an agent keeps between calls (the MCP server's ``sandbox_*`` tools), and the
reaper that destroys the ones it forgets.

Invariants:

- at most ``max_sandboxes`` are alive at once, sessions and one-shot runs together; a
  slot is taken before provisioning starts, so concurrent creates cannot overshoot;
- a session is destroyed when it has had no call in flight for ``idle_timeout_s``, when
  ``total_timeout_s`` has passed since its creation (whatever it is doing: this is also
  its sandbox's total timeout), when a quota violation terminated it, or at ``close()``;
- after ``close()`` nothing new is created, and everything alive has been destroyed;
- an id that is gone says why (``SandboxNotFoundError.detail``) for the last
  ``ENDED_MEMORY`` sessions, so an agent learns "expired after 900 s idle", not just
  "unknown id".

Every method blocks (provisioning, killing, removing a cgroup): the MCP server calls them
through ``aio.run_blocking``. Times come from the ``Scheduler``, so tests drive the reaper
with ``FakeScheduler``'s manual clock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from devs_sandbox.base import ProcessStatsSource, Scheduler, TimerHandle
from devs_sandbox.config import McpConfig, SandboxLifecycleConfig, ms_from_s, override
from devs_sandbox.errors import (
    DevsSandboxError,
    ExecTimeoutError,
    QuotaExceededError,
    SandboxNotFoundError,
    SessionLimitError,
)
from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
from devs_sandbox.models import ExecResult
from devs_sandbox.scheduler import ThreadScheduler
from devs_sandbox.tools.shell import MonitoredShellOptions, monitored_exec

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S: Final = 1.0  # an expired session outlives its timeout by at most this long
ENDED_MEMORY: Final = 1024  # ended session ids remembered with the reason they ended


class ServerClosingError(DevsSandboxError):
    """The registry was closed (the server is stopping); nothing new starts."""


@dataclass
class _Session:
    sandbox: Sandbox
    created_at: float
    last_used: float
    calls: int = 0


class SandboxSessions:
    """A registry of live sandboxes by id over one ``SandboxLifecycleManager``."""

    def __init__(
        self,
        manager: SandboxLifecycleManager,
        *,
        idle_timeout_s: float,
        total_timeout_s: float,
        max_sandboxes: int,
        scheduler: Scheduler | None = None,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        if idle_timeout_s <= 0 or total_timeout_s <= 0 or max_sandboxes < 1:
            raise ValueError("timeouts must be positive and max_sandboxes at least 1")
        self.manager = manager
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_sandboxes = max_sandboxes
        self._own_scheduler = scheduler is None
        self._scheduler: Scheduler = scheduler or ThreadScheduler("devs-sandbox-sessions")
        self._sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._pending = 0  # slots taken by creates in progress and one-shot runs
        self._timer: TimerHandle | None = None
        self._closed = False

    @classmethod
    def from_config(
        cls, manager: SandboxLifecycleManager, mcp: McpConfig, scheduler: Scheduler | None = None
    ) -> SandboxSessions:
        return cls(
            manager,
            idle_timeout_s=mcp.session_idle_timeout_s,
            total_timeout_s=mcp.session_timeout_s,
            max_sandboxes=mcp.max_sessions,
            scheduler=scheduler,
        )

    # -- bookkeeping (callers hold the lock) ------------------------------------------------
    def _take_slot_locked(self) -> None:
        if self._closed:
            raise ServerClosingError("the server is shutting down; no new sandbox starts")
        if len(self._sessions) + self._pending >= self.max_sandboxes:
            raise SessionLimitError(self.max_sandboxes)
        self._pending += 1

    def _remember_locked(self, sandbox_id: str, why: str) -> None:
        self._ended[sandbox_id] = why
        self._ended.move_to_end(sandbox_id)
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _missing(self, sandbox_id: str) -> SandboxNotFoundError:
        with self._lock:
            why = self._ended.get(sandbox_id, "")
        return SandboxNotFoundError(sandbox_id, why)

    def _arm_locked(self) -> None:
        if self._timer is None and not self._closed and self._sessions:
            self._timer = self._scheduler.call_later(self._sweep_interval_s, self._tick)

    # -- sessions -------------------------------------------------------------------------
    def create(self, config: SandboxLifecycleConfig | None = None) -> Sandbox:
        """Provision a sandbox that lives until destroyed, forgotten or the server stops."""
        with self._lock:
            self._take_slot_locked()
        try:
            base = config if config is not None else self.manager.config.sandbox
            # Its total timeout is the session's lifetime: the sweep destroys it then too.
            cfg = override(base, timeout_ms=ms_from_s(self.total_timeout_s))
            sandbox = self.manager.open_sandbox(cfg)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        now = self._scheduler.now()
        with self._lock:
            self._pending -= 1
            closed = self._closed
            if not closed:
                self._sessions[sandbox.id] = _Session(sandbox, now, now)
                self._arm_locked()
        if closed:
            sandbox.destroy()
            raise ServerClosingError("the server is shutting down; no new sandbox starts")
        return sandbox

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Count a one-shot run (run_shell_monitored) against ``max_sandboxes`` while it runs."""
        with self._lock:
            self._take_slot_locked()
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1

    @contextlib.contextmanager
    def use(self, sandbox_id: str) -> Iterator[Sandbox]:
        """The session's sandbox, marked busy (so not idle) for the duration of the call."""
        with self._lock:
            session = self._sessions.get(sandbox_id)
            if session is not None:
                session.calls += 1
                session.last_used = self._scheduler.now()
        if session is None:
            raise self._missing(sandbox_id)
        try:
            yield session.sandbox
        finally:
            with self._lock:
                session.calls -= 1
                session.last_used = self._scheduler.now()

    def remaining_s(self, sandbox_id: str) -> float:
        """Seconds left of the session's lifetime."""
        with self._lock:
            session = self._sessions.get(sandbox_id)
        if session is None:
            raise self._missing(sandbox_id)
        return self.total_timeout_s - (self._scheduler.now() - session.created_at)

    # REQ: 3_MCP-REQ-SEC-002
    def exec(
        self,
        sandbox_id: str,
        command: str,
        opts: MonitoredShellOptions,
        *,
        timeout_s: float,
        stats: ProcessStatsSource | None = None,
        scheduler: Scheduler | None = None,
    ) -> ExecResult:
        """Run ``command`` in the session's workspace under the RSS/CPU monitor.

        Raises ``ResourceLimitExceededError`` (the command was killed; the session and its
        files remain), ``ExecTimeoutError`` (``timeout_s`` ran out; the session remains),
        ``QuotaExceededError`` (a sandbox quota was broken: the session is destroyed) or
        ``SandboxNotFoundError`` (gone, or reached its lifetime during the call).
        """
        with self.use(sandbox_id) as sandbox:
            self._check_alive(sandbox)
            budget = min(timeout_s, self.remaining_s(sandbox_id))
            result = monitored_exec(
                sandbox, command, opts, timeout_s=budget, stats=stats, scheduler=scheduler
            )
            self._check_alive(sandbox)
        if result.timed_out:
            raise ExecTimeoutError(budget, result)
        return result

    def _check_alive(self, sandbox: Sandbox) -> None:
        """A session its quota or lifetime terminated is over: destroy it and say why."""
        if sandbox.destroyed:  # reaped or destroyed by another call meanwhile
            raise self._missing(sandbox.id)
        violation = sandbox.violation
        if violation is not None:
            self.end(sandbox.id, f"terminated for {violation.type}")
            raise QuotaExceededError(violation)
        if sandbox.timed_out:
            self.end(
                sandbox.id, f"reached its {self.total_timeout_s:g} s lifetime (mcp.sessionTimeoutS)"
            )
            raise self._missing(sandbox.id)

    def kill(self, sandbox_id: str) -> None:
        """SIGKILL the session's processes (a cancelled call); the session and files remain."""
        with self._lock:
            session = self._sessions.get(sandbox_id)
        if session is not None:
            session.sandbox.kill()

    def destroy(self, sandbox_id: str) -> None:
        """Destroy a session on request; an unknown or already destroyed id raises."""
        with self._lock:
            session = self._sessions.pop(sandbox_id, None)
            if session is not None:
                self._remember_locked(sandbox_id, "destroyed by sandbox_destroy")
        if session is None:
            raise self._missing(sandbox_id)
        session.sandbox.destroy()

    def end(self, sandbox_id: str, why: str) -> None:
        """Destroy a session for ``why``, if it is still there."""
        with self._lock:
            session = self._sessions.pop(sandbox_id, None)
            if session is not None:
                self._remember_locked(sandbox_id, why)
        if session is not None:
            session.sandbox.destroy()

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- the reaper ------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Destroy every session past its idle or total timeout; return their ids."""
        now = self._scheduler.now()
        expired: list[tuple[_Session, str]] = []
        with self._lock:
            for sandbox_id, session in list(self._sessions.items()):
                if now - session.created_at >= self.total_timeout_s:
                    why = f"reached its {self.total_timeout_s:g} s lifetime (mcp.sessionTimeoutS)"
                elif session.calls == 0 and now - session.last_used >= self.idle_timeout_s:
                    why = f"destroyed after {self.idle_timeout_s:g} s without a call"
                    why += " (mcp.sessionIdleTimeoutS)"
                else:
                    continue
                del self._sessions[sandbox_id]
                self._remember_locked(sandbox_id, why)
                expired.append((session, why))
        for session, why in expired:
            logger.info("sandbox %s %s", session.sandbox.id, why)
            try:
                session.sandbox.destroy()
            except Exception:
                logger.exception("destroying expired sandbox %s failed", session.sandbox.id)
        return [s.sandbox.id for s, _ in expired]

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.sweep()
        finally:
            with self._lock:
                self._arm_locked()

    def close(self) -> None:
        """Destroy every session and stop the reaper; idempotent. (One-shot runs belong to
        the manager: ``manager.shutdown()`` destroys them.)"""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions.items())
            self._sessions.clear()
            for sandbox_id, _ in sessions:
                self._remember_locked(sandbox_id, "destroyed when the server stopped")
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        for sandbox_id, session in sessions:
            try:
                session.sandbox.destroy()
            except Exception:
                logger.exception("destroying sandbox %s at shutdown failed", sandbox_id)
        if self._own_scheduler and isinstance(self._scheduler, ThreadScheduler):
            self._scheduler.shutdown()

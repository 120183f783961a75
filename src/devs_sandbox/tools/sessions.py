"""Sandboxes an agent keeps between calls (the MCP server's ``sandbox_*`` tools), who owns
each of them, and the reaper that destroys the ones it forgets.

Invariants:

- every sandbox belongs to the owner that created it (an opaque string: the MCP server
  gives each client session its own); a lookup with any other owner finds nothing, and
  says so exactly as for an id that never existed, so a guessed id reveals nothing;
- at most ``max_sandboxes`` are alive at once, sessions and one-shot runs together, and
  at most ``max_per_owner`` of them for one owner; a slot is taken before provisioning
  starts, so concurrent creates cannot overshoot;
- a session is destroyed when it has had no call in flight for ``idle_timeout_s``, when
  ``total_timeout_s`` has passed since its creation (whatever it is doing: this is also
  its sandbox's total timeout), when a quota violation terminated it, when its owner
  ended (``end_owner``: the MCP client session went away), or at ``close()``;
- after ``end_owner(o)`` nothing new is created for ``o``; after ``close()`` nothing new is
  created at all, and everything alive has been destroyed;
- an id that is gone says why (``SandboxNotFoundError.detail``) for the last
  ``ENDED_MEMORY`` sessions, to its owner only, so an agent learns "expired after 900 s
  idle", not just "unknown id";
- ``owned_ids(o)`` names the sandboxes ``o`` created (sessions and one-shot runs, the
  newest ``OWNED_MEMORY``), which is how the server shows an owner its own audit rows.

Every method blocks (provisioning, killing, removing a cgroup): the MCP server calls them
through ``aio.run_blocking``. Times come from the ``Scheduler``, so tests drive the reaper
with ``FakeScheduler``'s manual clock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from devs_sandbox.base import ProcessStatsSource, Scheduler, TimerHandle
from devs_sandbox.config import McpConfig, SandboxLifecycleConfig, ms_from_s, override
from devs_sandbox.errors import (
    DevsSandboxError,
    ExecTimeoutError,
    QuotaExceededError,
    ResourceLimitExceededError,
    SandboxNotFoundError,
    SessionLimitError,
)
from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
from devs_sandbox.models import ExecResult, SandboxOutcome
from devs_sandbox.scheduler import ThreadScheduler
from devs_sandbox.tools.shell import MonitoredShellOptions, OutputTap, monitored_exec

logger = logging.getLogger(__name__)

SIGNAL_STATUS: Final = 128  # a shell's status above this: a child was killed by a signal
ALIVE_PROBE: Final = ("/bin/sh", "-c", "true")  # after a monitor kill: is the sandbox still up?
ALIVE_PROBE_TIMEOUT_S: Final = 10.0  # one docker exec on a loaded host
SWEEP_INTERVAL_S: Final = 1.0  # an expired session outlives its timeout by at most this long
ENDED_MEMORY: Final = 1024  # ended session ids (and ended owners) remembered, with why
OWNED_MEMORY: Final = 10_000  # sandbox ids remembered per live owner, for its audit rows
DEFAULT_OWNER: Final = "local"  # the one owner of a single-client server (stdio, the library)


class ServerClosingError(DevsSandboxError):
    """The registry was closed (the server is stopping), or the caller's owner has ended
    (its MCP session went away); nothing new starts for it."""


class OwnerLimitError(SessionLimitError):
    """A new sandbox would exceed the most one owner (one MCP client session) may hold
    (``mcp.maxSessionsPerClient``)."""

    def __init__(self, limit: int) -> None:
        DevsSandboxError.__init__(
            self,
            f"too many sandboxes for this client: {limit} (mcp.maxSessionsPerClient); destroy "
            "one with sandbox_destroy or wait for a run to finish",
        )
        self.limit = limit


@dataclass
class _Session:
    sandbox: Sandbox
    owner: str
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
        max_per_owner: int | None = None,
        scheduler: Scheduler | None = None,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        if idle_timeout_s <= 0 or total_timeout_s <= 0 or max_sandboxes < 1:
            raise ValueError("timeouts must be positive and max_sandboxes at least 1")
        if max_per_owner is not None and max_per_owner < 1:
            raise ValueError("max_per_owner must be at least 1")
        self.manager = manager
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_sandboxes = max_sandboxes
        self.max_per_owner = max_per_owner
        self._own_scheduler = scheduler is None
        self._scheduler: Scheduler = scheduler or ThreadScheduler("devs-sandbox-sessions")
        self._sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (owner, why)
        self._pending = 0  # slots taken by creates in progress and one-shot runs
        self._pending_by_owner: Counter[str] = Counter()
        self._owned: dict[str, OrderedDict[str, None]] = {}  # owner -> ids it created
        self._ended_owners: OrderedDict[str, None] = OrderedDict()
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
            max_per_owner=mcp.max_sessions_per_client,
            scheduler=scheduler,
        )

    # -- bookkeeping (callers hold the lock) ------------------------------------------------
    def _take_slot_locked(self, owner: str) -> None:
        if self._closed:
            raise ServerClosingError("the server is shutting down; no new sandbox starts")
        if owner in self._ended_owners:
            raise ServerClosingError("this client's MCP session has ended; no new sandbox starts")
        if len(self._sessions) + self._pending >= self.max_sandboxes:
            raise SessionLimitError(self.max_sandboxes)
        if self.max_per_owner is not None:
            held = sum(1 for s in self._sessions.values() if s.owner == owner)
            if held + self._pending_by_owner[owner] >= self.max_per_owner:
                raise OwnerLimitError(self.max_per_owner)
        self._pending += 1
        self._pending_by_owner[owner] += 1

    def _give_slot_back_locked(self, owner: str) -> None:
        self._pending -= 1
        self._pending_by_owner[owner] -= 1
        if not self._pending_by_owner[owner]:
            del self._pending_by_owner[owner]

    def _own_locked(self, owner: str, sandbox_id: str) -> None:
        ids = self._owned.setdefault(owner, OrderedDict())
        ids[sandbox_id] = None
        while len(ids) > OWNED_MEMORY:
            ids.popitem(last=False)

    def _remember_locked(self, sandbox_id: str, owner: str, why: str) -> None:
        self._ended[sandbox_id] = (owner, why)
        self._ended.move_to_end(sandbox_id)
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _session_locked(self, sandbox_id: str, owner: str) -> _Session | None:
        """The one place a sandbox id is looked up for a caller: another owner's is absent."""
        session = self._sessions.get(sandbox_id)
        return session if session is not None and session.owner == owner else None

    def _missing(self, sandbox_id: str, owner: str) -> SandboxNotFoundError:
        """Not found, with the story of its end told to its own owner only."""
        with self._lock:
            whose, why = self._ended.get(sandbox_id, ("", ""))
        return SandboxNotFoundError(sandbox_id, why if whose == owner else "")

    def _arm_locked(self) -> None:
        if self._timer is None and not self._closed and self._sessions:
            self._timer = self._scheduler.call_later(self._sweep_interval_s, self._tick)

    # -- sessions -------------------------------------------------------------------------
    def create(
        self, config: SandboxLifecycleConfig | None = None, *, owner: str = DEFAULT_OWNER
    ) -> Sandbox:
        """Provision a sandbox for ``owner`` that lives until destroyed, forgotten, its owner
        ends or the server stops."""
        with self._lock:
            self._take_slot_locked(owner)
        try:
            base = config if config is not None else self.manager.config.sandbox
            # Its total timeout is the session's lifetime: the sweep destroys it then too.
            cfg = override(base, timeout_ms=ms_from_s(self.total_timeout_s))
            sandbox = self.manager.open_sandbox(cfg)
        except BaseException:
            with self._lock:
                self._give_slot_back_locked(owner)
            raise
        now = self._scheduler.now()
        with self._lock:
            self._give_slot_back_locked(owner)
            refused = self._closed or owner in self._ended_owners
            if not refused:
                self._sessions[sandbox.id] = _Session(sandbox, owner, now, now)
                self._own_locked(owner, sandbox.id)
                self._arm_locked()
        if refused:
            # The server stopped, or the owner's session ended, while this one was made.
            sandbox.destroy()
            raise ServerClosingError("the server or this client's session is ending")
        return sandbox

    @contextlib.contextmanager
    def slot(self, *, owner: str = DEFAULT_OWNER, sandbox_id: str | None = None) -> Iterator[None]:
        """Count a one-shot run (run_shell_monitored) against ``max_sandboxes`` and its
        owner's share while it runs; ``sandbox_id`` (chosen by the caller) joins
        ``owned_ids(owner)``."""
        with self._lock:
            self._take_slot_locked(owner)
            if sandbox_id is not None:
                self._own_locked(owner, sandbox_id)
        try:
            yield
        finally:
            with self._lock:
                self._give_slot_back_locked(owner)

    @contextlib.contextmanager
    def use(self, sandbox_id: str, *, owner: str = DEFAULT_OWNER) -> Iterator[Sandbox]:
        """The session's sandbox, marked busy (so not idle) for the duration of the call."""
        with self._lock:
            session = self._session_locked(sandbox_id, owner)
            if session is not None:
                session.calls += 1
                session.last_used = self._scheduler.now()
        if session is None:
            raise self._missing(sandbox_id, owner)
        try:
            yield session.sandbox
        finally:
            with self._lock:
                session.calls -= 1
                session.last_used = self._scheduler.now()

    def remaining_s(self, sandbox_id: str, *, owner: str = DEFAULT_OWNER) -> float:
        """Seconds left of the session's lifetime."""
        with self._lock:
            session = self._session_locked(sandbox_id, owner)
        if session is None:
            raise self._missing(sandbox_id, owner)
        return self.total_timeout_s - (self._scheduler.now() - session.created_at)

    def owned_ids(self, owner: str) -> list[str]:
        """Ids of the sandboxes ``owner`` created, oldest first (at most ``OWNED_MEMORY``)."""
        with self._lock:
            return list(self._owned.get(owner, ()))

    # REQ: 3_MCP-REQ-SEC-002
    def exec(
        self,
        sandbox_id: str,
        command: str,
        opts: MonitoredShellOptions,
        *,
        timeout_s: float,
        owner: str = DEFAULT_OWNER,
        stats: ProcessStatsSource | None = None,
        scheduler: Scheduler | None = None,
        tap: OutputTap | None = None,
    ) -> ExecResult:
        """Run ``command`` in the workspace of ``owner``'s session under the RSS/CPU monitor.

        Raises ``ResourceLimitExceededError`` (the command was killed; the session and its
        files remain, unless the kill stopped the sandbox itself: then the session is over
        and ``ended_why`` says so), ``ExecTimeoutError`` (``timeout_s`` ran out; the session
        remains), ``QuotaExceededError`` (a sandbox quota was broken, by this command: the
        session is destroyed) or ``SandboxNotFoundError`` (gone, another owner's, reached
        its lifetime during the call, or lost underneath: the session is then over).
        """
        with self.use(sandbox_id, owner=owner) as sandbox:
            self._check_alive(sandbox, owner)
            budget = min(timeout_s, self.remaining_s(sandbox_id, owner=owner))
            try:
                result = monitored_exec(
                    sandbox,
                    command,
                    opts,
                    timeout_s=budget,
                    stats=stats,
                    scheduler=scheduler,
                    tap=tap,
                )
            except ResourceLimitExceededError as exc:
                self._after_monitor_kill(sandbox, exc)
                raise
            except SandboxNotFoundError as exc:
                self._lost(sandbox)
                raise self._missing(sandbox_id, owner) from exc
            if result.exit_code > SIGNAL_STATUS or result.signal is not None:
                # Killed: by the kernel for a quota (an OOM kill) between two polls? Then
                # this call is the one that broke it, and says so.
                sandbox.settle(result)
            self._check_alive(sandbox, owner, result)
        if result.timed_out:
            raise ExecTimeoutError(budget, result)
        return result

    def _check_alive(self, sandbox: Sandbox, owner: str, result: ExecResult | None = None) -> None:
        """A session its quota or lifetime terminated is over: destroy it and say why
        (with ``result``, the exec that broke the quota, in the error's outcome)."""
        if sandbox.destroyed:  # reaped or destroyed by another call meanwhile
            raise self._missing(sandbox.id, owner)
        violation = sandbox.violation
        if violation is not None:
            self.end(sandbox.id, f"terminated for {violation.type}")
            outcome = None
            if result is not None:
                outcome = SandboxOutcome(
                    sandbox_id=sandbox.id,
                    driver=sandbox.context.driver,
                    isolation=sandbox.isolation,
                    result=result,
                    violation=violation,
                )
            raise QuotaExceededError(violation, outcome)
        if sandbox.timed_out:
            self.end(
                sandbox.id, f"reached its {self.total_timeout_s:g} s lifetime (mcp.sessionTimeoutS)"
            )
            raise self._missing(sandbox.id, owner)

    def _after_monitor_kill(self, sandbox: Sandbox, exc: ResourceLimitExceededError) -> None:
        """The monitor killed the command; on a driver whose kill stops the sandbox itself
        (a container whose init was killed) the session is over: end it, saying why."""
        try:
            # Whatever its status: the driver could still run something there.
            sandbox.exec(ALIVE_PROBE, timeout_s=ALIVE_PROBE_TIMEOUT_S)
            alive = True
        except DevsSandboxError:
            alive = False
        if not alive:
            self.end(
                sandbox.id,
                f"stopped when its command was killed for {exc.reason} (the {sandbox.driver.name} "
                "driver's kill reaches the whole sandbox)",
            )

    def _lost(self, sandbox: Sandbox) -> None:
        """The driver no longer has a sandbox the session still holds (its container died):
        end the session, so this call and every later one (sandbox_destroy too) say it is
        gone and why."""
        if not sandbox.destroyed:
            self.end(sandbox.id, f"lost: the {sandbox.driver.name} driver no longer has it")

    def ended_why(self, sandbox_id: str, owner: str = DEFAULT_OWNER) -> str:
        """Why ``owner``'s session ``sandbox_id`` ended ("" if it did not, or not for it)."""
        with self._lock:
            if self._session_locked(sandbox_id, owner) is not None:
                return ""
            whose, why = self._ended.get(sandbox_id, ("", ""))
        return why if whose == owner else ""

    def kill(self, sandbox_id: str, *, owner: str = DEFAULT_OWNER) -> None:
        """SIGKILL the session's processes (a cancelled call); the session and files remain."""
        with self._lock:
            session = self._session_locked(sandbox_id, owner)
        if session is not None:
            session.sandbox.kill()

    def destroy(self, sandbox_id: str, *, owner: str = DEFAULT_OWNER) -> None:
        """Destroy ``owner``'s session on request; an unknown, already destroyed or another
        owner's id raises ``SandboxNotFoundError``."""
        with self._lock:
            session = self._session_locked(sandbox_id, owner)
            if session is not None:
                del self._sessions[sandbox_id]
                self._remember_locked(sandbox_id, owner, "destroyed by sandbox_destroy")
        if session is None:
            raise self._missing(sandbox_id, owner)
        session.sandbox.destroy()

    def end(self, sandbox_id: str, why: str) -> None:
        """Destroy a session for ``why``, if it is still there (the server's own bookkeeping:
        a cancelled create, a failed preflight; whoever owns it)."""
        with self._lock:
            session = self._sessions.pop(sandbox_id, None)
            if session is not None:
                self._remember_locked(sandbox_id, session.owner, why)
        if session is not None:
            session.sandbox.destroy()

    def end_owner(self, owner: str, why: str) -> list[str]:
        """``owner`` is gone (its MCP session ended): destroy its sessions, forget what it
        created, and refuse it anything new. Returns the ids destroyed; idempotent."""
        with self._lock:
            self._ended_owners[owner] = None
            self._ended_owners.move_to_end(owner)
            while len(self._ended_owners) > ENDED_MEMORY:
                self._ended_owners.popitem(last=False)
            self._owned.pop(owner, None)
            mine = [(i, s) for i, s in self._sessions.items() if s.owner == owner]
            for sandbox_id, _ in mine:
                del self._sessions[sandbox_id]
                self._remember_locked(sandbox_id, owner, why)
        for sandbox_id, session in mine:
            logger.info("sandbox %s %s", sandbox_id, why)
            try:
                session.sandbox.destroy()
            except Exception:
                logger.exception("destroying sandbox %s failed", sandbox_id)
        return [sandbox_id for sandbox_id, _ in mine]

    def ids(self, owner: str | None = None) -> list[str]:
        """Live session ids: all of them, or ``owner``'s."""
        with self._lock:
            return [i for i, s in self._sessions.items() if owner is None or s.owner == owner]

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
                self._remember_locked(sandbox_id, session.owner, why)
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
            for sandbox_id, session in sessions:
                self._remember_locked(
                    sandbox_id, session.owner, "destroyed when the server stopped"
                )
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

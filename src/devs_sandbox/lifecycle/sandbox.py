"""A live sandbox owned by a manager: exec in it, inspect it, destroy it (idempotent).

A sandbox whose total timeout fired, that broke a quota or was cancelled runs nothing
more: a multi-step task is stopped at its next exec, not only at the exec that was
running when the limit struck. ``destroy`` is guarded, so a second call (from a timer,
a signal handler, the MCP server's shutdown) is a no-op.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devs_sandbox.base import ExecRequest, SandboxDriver
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.errors import (
    DiskQuotaExceededError,
    QuotaExceededError,
    SandboxCancelledError,
    SandboxNotFoundError,
    SandboxTimeoutError,
)
from devs_sandbox.events import SandboxEvents
from devs_sandbox.lifecycle import files
from devs_sandbox.models import ExecResult, SandboxContext, Violation, ViolationType

if TYPE_CHECKING:
    from devs_sandbox.lifecycle.manager import SandboxLifecycleManager


class Sandbox:
    """A live sandbox owned by a manager: exec in it, inspect it, destroy it (idempotent)."""

    def __init__(
        self,
        manager: SandboxLifecycleManager,
        driver: SandboxDriver,
        ctx: SandboxContext,
        config: SandboxLifecycleConfig,
    ) -> None:
        self.manager = manager
        self.driver = driver
        self.context = ctx
        self.config = config
        self.opened_at = time.monotonic()
        self.last_activity = self.opened_at
        self._destroyed = False
        self._destroy_lock = threading.Lock()
        self.cancelled = False

    @property
    def id(self) -> str:
        return self.context.id

    @property
    def isolation(self) -> tuple[str, ...]:
        return self.context.isolation

    @property
    def workspace(self) -> Path:
        return self.context.workspace

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def timed_out(self) -> bool:
        return self.manager.enforcer.fired(self.id)

    @property
    def violation(self) -> Violation | None:
        return self.manager.detector.violation_for(self.id)

    def remaining_s(self) -> float:
        return self.config.timeout_s - (time.monotonic() - self.opened_at)

    def settle(self, result: ExecResult) -> Violation | None:
        """After one exec of a sandbox that lives on (an MCP session): record now what the
        kernel enforced during it between two polls (an OOM kill, SIGXFSZ), as a one-shot
        run does at its end, so the exec that broke the quota is the one that reports it.
        Returns the sandbox's violation, if any."""
        return self.manager._final_violation(self, result)

    def exec(self, command: str | Sequence[str] | ExecRequest, **options: Any) -> ExecResult:
        """Run one command in this sandbox's workspace (a str goes through ``sh -c``).

        ``options`` are the fields of ``ExecRequest`` (``timeout_s``, ``stdin``, ``env``,
        ``on_stdout``, ...): the request is the one place the exec signature lives.

        A sandbox whose total timeout fired, that broke a quota or was cancelled runs
        nothing more: a multi-step task is stopped at its next exec, not only the exec
        that was running when the limit struck.
        """
        if self._destroyed:
            raise SandboxNotFoundError(self.id)
        self._refuse_if_ended()
        if isinstance(command, ExecRequest):
            request = command.replace(**options) if options else command
        else:
            request = ExecRequest.of(command, **options)
        self.manager.runtimes.check(self.driver, self.config, request.argv)
        self.last_activity = time.monotonic()
        try:
            return self.driver.exec(self.context, request)
        finally:
            self.last_activity = time.monotonic()

    def _refuse_if_ended(self) -> None:
        if self.cancelled:
            raise SandboxCancelledError(f"sandbox {self.id} was cancelled")
        if self.timed_out:
            raise SandboxTimeoutError(self.config.timeout_s)
        violation = self.manager.detector.violation_for(self.id, settle_timeout_s=0)
        if violation is not None:
            if violation.type == ViolationType.DISK_QUOTA_EXCEEDED:
                raise DiskQuotaExceededError(violation)
            raise QuotaExceededError(violation)

    # -- files of the workspace (lifecycle/files.py: each runs inside the sandbox) ----------
    def read_file(self, path: str, *, max_bytes: int = files.DEFAULT_MAX_READ_BYTES) -> bytes:
        """The bytes of ``path`` (relative to the workspace); ``SandboxFileError`` for a
        path out of the workspace, a missing or non-regular file, one over ``max_bytes``."""
        return files.read_file(self, path, max_bytes=max_bytes)

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace ``path`` (parents made) with ``data``; never through a symlink."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        files.write_file(self, path, raw, mode=mode)

    def list_files(self, path: str = ".") -> list[files.FileEntry]:
        """The entries of the directory ``path``, sorted by name."""
        return files.list_files(self, path)

    def copy_out(
        self, source: str, dest: Path, *, max_bytes: int = files.DEFAULT_MAX_COPY_OUT_BYTES
    ) -> Path:
        """Copy ``source`` (file or directory) into the host directory ``dest``."""
        return files.copy_out(self, source, dest, max_bytes=max_bytes)

    def kill(self) -> None:
        """SIGKILL every process of the sandbox (what the timeout enforcer calls)."""
        self.driver.force_stop(self.context)

    def destroy(self) -> None:
        with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True
        try:
            self.manager.enforcer.clear(self.id)
            self.manager.detector.forget(self.id)
        finally:
            try:
                self.driver.destroy(self.context)
            finally:
                self.manager.keys.revoke_key(self.id)
                self.manager.release(self)
                self.manager.bus.emit(SandboxEvents.DESTROYED, {"sandbox_id": self.id})

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

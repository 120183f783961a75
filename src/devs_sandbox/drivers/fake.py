"""A scripted driver that ships in the library, so tests of the lifecycle, the detector and
the CLI build the real objects around a fake backend instead of patching module paths.

It does no isolation at all: never use it to run untrusted code. Results and
metrics are scripted; every call is recorded for assertions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from devs_sandbox.base import ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.errors import ProvisionError, QuotaExceededError, SandboxNotFoundError
from devs_sandbox.models import (
    CapturedStream,
    ExecResult,
    ResourceUsage,
    SandboxContext,
    SandboxMetrics,
    new_sandbox_id,
    validate_sandbox_id,
)

ExecHandler = Callable[["FakeSandbox", Sequence[str]], ExecResult]
MetricsHandler = Callable[["FakeSandbox"], SandboxMetrics]


def ok_result(stdout: str = "", exit_code: int = 0, stderr: str = "") -> ExecResult:
    return ExecResult(
        exit_code=exit_code,
        stdout=CapturedStream(stdout, total_bytes=len(stdout)),
        stderr=CapturedStream(stderr, total_bytes=len(stderr)),
        duration_s=0.0,
        resources=ResourceUsage(cpu_time_s=0.0, peak_memory_bytes=0, peak_processes=1),
    )


def killed_result() -> ExecResult:
    return ExecResult(
        exit_code=137,
        stdout=CapturedStream(),
        stderr=CapturedStream(),
        duration_s=0.0,
        signal=9,
    )


@dataclass
class FakeSandbox:
    ctx: SandboxContext
    config: SandboxLifecycleConfig
    commands: list[list[str]] = field(default_factory=list)
    requests: list[ExecRequest] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)
    force_stops: int = 0
    samples: int = 0
    pid: int | None = None  # reported to on_start when a test sets it


class FakeDriver:
    """Scripted backend. ``exec_handler`` decides each exec's result; ``metrics`` is a list
    of samples served in order (the last one repeats) or a function of the sandbox."""

    name = "fake"

    def __init__(
        self,
        *,
        exec_handler: ExecHandler | None = None,
        metrics: Iterable[SandboxMetrics] | MetricsHandler | None = None,
        isolation: tuple[str, ...] = ("fake",),
        fail_provision: bool = False,
        runtimes: frozenset[str] | None = None,
    ) -> None:
        self.exec_handler = exec_handler or (lambda _sb, _cmd: ok_result())
        self._metrics_handler: MetricsHandler | None = None
        self._metrics_list: list[SandboxMetrics] = []
        if callable(metrics):
            self._metrics_handler = metrics
        elif metrics is not None:
            self._metrics_list = list(metrics)
        self.isolation = isolation
        self.fail_provision = fail_provision
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.destroyed: list[str] = []
        self.provisioned: list[str] = []
        self.secret_names: list[list[str]] = []  # names only: a fake has no business keeping values
        self.runtimes = runtimes  # what provided_runtimes answers (None: cannot tell)
        self.quota_errors: list[tuple[str, QuotaExceededError]] = []
        self.closed = False
        self._lock = threading.Lock()

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        del config
        return dict.fromkeys(self.isolation, "")

    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        self.secret_names.append(sorted(secrets or {}))
        sandbox_id = validate_sandbox_id(config.sandbox_id or new_sandbox_id())
        if self.fail_provision:
            raise ProvisionError("scripted provision failure")
        ctx = SandboxContext(
            id=sandbox_id,
            driver=self.name,
            workspace=Path("/nonexistent/fake") / sandbox_id,
            isolation=self.isolation,
        )
        with self._lock:
            if sandbox_id in self.sandboxes:
                raise ProvisionError(f"sandbox {sandbox_id} already exists")
            self.sandboxes[sandbox_id] = FakeSandbox(ctx, config)
            self.provisioned.append(sandbox_id)
        return ctx

    def _get(self, ctx: SandboxContext) -> FakeSandbox:
        with self._lock:
            sb = self.sandboxes.get(ctx.id)
        if sb is None:
            raise SandboxNotFoundError(ctx.id)
        return sb

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        sb = self._get(ctx)
        command = list(request.argv)
        sb.commands.append(command)
        sb.requests.append(request)
        if request.on_start is not None and sb.pid is not None:
            request.on_start(sb.pid)
        start = time.monotonic()
        result = self.exec_handler(sb, command)
        if request.timeout_s is not None and time.monotonic() - start > request.timeout_s:
            result = ExecResult(
                exit_code=137,
                stdout=result.stdout,
                stderr=result.stderr,
                duration_s=time.monotonic() - start,
                timed_out=True,
                signal=9,
            )
        if request.on_stdout is not None and result.stdout.text:
            request.on_stdout(result.stdout.text.encode())
        if request.on_stderr is not None and result.stderr.text:
            request.on_stderr(result.stderr.text.encode())
        return result

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        sb = self._get(ctx)
        sb.samples += 1
        if self._metrics_handler is not None:
            return self._metrics_handler(sb)
        if self._metrics_list:
            i = min(sb.samples - 1, len(self._metrics_list) - 1)
            m = self._metrics_list[i]
            return replace(m, sandbox_id=ctx.id)
        return SandboxMetrics(sandbox_id=ctx.id, timestamp=time.monotonic())

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            sb = self.sandboxes.get(ctx.id)
        return sb is not None and not sb.stopped.is_set()

    def force_stop(self, ctx: SandboxContext) -> None:
        with self._lock:
            sb = self.sandboxes.get(ctx.id)
        if sb is not None:
            sb.force_stops += 1
            sb.stopped.set()

    def destroy(self, ctx: SandboxContext) -> None:
        with self._lock:
            sb = self.sandboxes.pop(ctx.id, None)
            self.destroyed.append(ctx.id)
        if sb is not None:
            sb.stopped.set()

    def reap_orphans(self) -> list[str]:
        return []

    def member_pids(self, ctx: SandboxContext) -> list[int]:
        sb = self._get(ctx)
        return [] if sb.pid is None else [sb.pid]

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        del config
        return self.runtimes

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        self.quota_errors.append((ctx.id, error))

    def close(self) -> None:
        self.closed = True

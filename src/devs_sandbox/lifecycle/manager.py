"""The lifecycle: one fresh sandbox per run, limits watched, destroyed on every exit path.

Data flows one way: config -> this manager -> driver -> monitors (timeout
enforcer, drain detector) -> event bus -> store. The manager owns each sandbox
it opens; monitors only report and terminate through the driver, the manager
decides what the run's outcome is and always destroys.

Exit paths covered by ``run_in_sandbox``'s ``finally``: success, non-zero exit,
preflight failure, quota violation, total timeout, idle timeout, cancellation
(``cancel`` or asyncio cancellation of ``arun_in_sandbox``), KeyboardInterrupt,
and a failure of our own. ``Sandbox.destroy`` is guarded, so a second call (from
a timer, a signal handler, the MCP server's shutdown) is a no-op.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from devs_sandbox.base import OutputCallback, SandboxDriver
from devs_sandbox.config import DevsConfig, SandboxLifecycleConfig, default_db_path, override
from devs_sandbox.drivers import create_driver
from devs_sandbox.errors import (
    DiskQuotaExceededError,
    QuotaExceededError,
    SandboxCancelledError,
    SandboxNotFoundError,
    SandboxPreFlightError,
    SandboxTimeoutError,
    UnsupportedRuntimeError,
)
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.lifecycle.sandbox import Sandbox
from devs_sandbox.lifecycle.timeout import SandboxTimeoutEnforcer
from devs_sandbox.lifecycle.watchdog import ResourceDrainDetector
from devs_sandbox.models import (
    DetectionRule,
    ExecResult,
    SandboxOutcome,
    Violation,
    ViolationType,
    new_sandbox_id,
)
from devs_sandbox.runtimes import RuntimeCompatibilityChecker
from devs_sandbox.security.environment import EnvironmentSanitizer
from devs_sandbox.security.session_keys import (
    SESSION_KEY_NAME,
    SessionKeyManager,
    session_key_manager,
    wipe,
)
from devs_sandbox.store import ViolationStore

logger = logging.getLogger(__name__)

Task = str | Sequence[str] | Callable[[Sandbox], ExecResult]


def _argv(command: str | Sequence[str]) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise ValueError("command must not be empty")
        return ["/bin/sh", "-c", command]
    argv = list(command)
    if not argv:
        raise ValueError("command must not be empty")
    return argv


# REQ: 8_RISKS-REQ-123
# REQ: 1_PRD-REQ-SEC-010
class SandboxLifecycleManager:
    """Opens sandboxes through the configured driver and runs tasks in them."""

    def __init__(
        self,
        driver: SandboxDriver | None = None,
        *,
        config: DevsConfig | None = None,
        bus: EventBus | None = None,
        store: ViolationStore | Literal["default"] | None = "default",
        enforcer: SandboxTimeoutEnforcer | None = None,
        detector: ResourceDrainDetector | None = None,
        reap_orphans: bool = True,
        key_manager: SessionKeyManager | None = None,
        host_env: Mapping[str, str] | None = None,
    ) -> None:
        """``host_env``: the environment sandboxes may take harmless variables from
        (through the sanitizer); default this process's."""
        self.config = config or DevsConfig()
        self.bus = bus or EventBus()
        if store == "default":
            store = ViolationStore(self.config.store.path or default_db_path())
        self.store = store
        if self.store is not None:
            self.store.attach(self.bus)
        self.enforcer = enforcer or SandboxTimeoutEnforcer(
            self.config.sandbox.timeout_s, bus=self.bus
        )
        if self.enforcer.bus is None:
            self.enforcer.bus = self.bus
        self.detector = detector or ResourceDrainDetector(bus=self.bus)
        self.runtimes = RuntimeCompatibilityChecker()
        self._drivers: dict[str, SandboxDriver] = {}
        if driver is not None:
            self._drivers[driver.name] = driver
        self._fixed_driver = driver
        self.keys = key_manager or session_key_manager
        env_cfg = self.config.environment
        self.sanitizer = EnvironmentSanitizer(env_cfg.extra_allow, env_cfg.extra_deny)
        self._host_env = host_env
        self._reap = reap_orphans
        self._reaped: set[str] = set()
        self._live: dict[str, Sandbox] = {}
        self._lock = threading.Lock()

    # -- drivers ------------------------------------------------------------------------
    def driver_for(self, config: SandboxLifecycleConfig) -> SandboxDriver:
        if self._fixed_driver is not None:
            return self._fixed_driver
        with self._lock:
            driver = self._drivers.get(config.driver)
            if driver is None:
                driver = create_driver(
                    config.driver,
                    emit=self.bus.emit,
                    sanitizer=self.sanitizer,
                    host_env=self._host_env,
                    # the cluster it binds to (and reaps in)
                    kubernetes=config.kubernetes if config.driver == "kubernetes" else None,
                )
                self._drivers[config.driver] = driver
        return driver

    def config_for(
        self, config: SandboxLifecycleConfig, argv: Sequence[str]
    ) -> SandboxLifecycleConfig:
        """``config``, or its ``fallbackDriver`` variant when only that driver provides the
        runtime ``argv`` needs; ``UnsupportedRuntimeError`` when neither does."""
        try:
            self.runtimes.check(self.driver_for(config), config, argv)
        except UnsupportedRuntimeError as exc:
            fallback = config.fallback_driver
            if fallback is None or fallback == config.driver or self._fixed_driver is not None:
                raise
            alternative = override(config, driver=fallback)
            try:
                self.runtimes.check(self.driver_for(alternative), alternative, argv)
            except Exception as again:
                raise exc from again
            logger.info(
                "%s driver lacks the %s runtime; falling back to the %s driver",
                config.driver,
                exc.runtime,
                fallback,
            )
            return alternative
        return config

    def reap_orphans(self, driver: SandboxDriver | None = None) -> list[str]:
        """Destroy sandboxes left by dead processes (what ``devs-sandbox cleanup`` runs)."""
        drivers = [driver] if driver is not None else list(self._drivers.values())
        reaped: list[str] = []
        for d in drivers:
            try:
                ids = d.reap_orphans()
            except Exception:
                logger.exception("reaping orphans of the %s driver failed", d.name)
                continue
            for sandbox_id in ids:
                self.bus.emit(
                    SandboxEvents.ORPHAN_REAPED, {"sandbox_id": sandbox_id, "driver": d.name}
                )
            reaped += ids
        return reaped

    def _reap_once(self, driver: SandboxDriver) -> None:
        if not self._reap or driver.name in self._reaped:
            return
        self._reaped.add(driver.name)
        reaped = self.reap_orphans(driver)
        if reaped:
            logger.info("reaped %d orphaned sandbox(es): %s", len(reaped), ", ".join(reaped))

    # -- sandboxes ----------------------------------------------------------------------
    def open_sandbox(
        self,
        config: SandboxLifecycleConfig | None = None,
        *,
        secrets: Mapping[str, bytes | str] | None = None,
    ) -> Sandbox:
        """Provision a fresh sandbox, arm its total timeout and start its drain detector.

        A session key is generated and registered for it, and delivered with ``secrets``
        (name -> value) as files whose paths are in ``NAME_FILE``; the key is revoked when
        the sandbox is destroyed, whatever ends it.
        """
        cfg = config or self.config.sandbox
        driver = self.driver_for(cfg)
        self._reap_once(driver)
        key = self.keys.generate_key()
        # Our working copies are bytearrays, zeroed once the driver has taken its own.
        payload: dict[str, bytearray] = {SESSION_KEY_NAME: bytearray(key.hex().encode())}
        try:
            for name, given in (secrets or {}).items():
                payload[name] = bytearray(given.encode() if isinstance(given, str) else given)
            # The id is the driver's to choose (a warm pool hands out ready containers).
            ctx = driver.provision(cfg, secrets=payload)
        except BaseException:
            wipe([key])
            raise
        finally:
            wipe(payload.values())
        try:
            self.keys.register_key(ctx.id, key)
        except BaseException:
            wipe([key])
            driver.destroy(ctx)
            raise
        sandbox = Sandbox(self, driver, ctx, cfg)
        with self._lock:
            self._live[ctx.id] = sandbox
        try:
            self.enforcer.watch(sandbox, ctx.id, cfg.timeout_s)
            self.detector.register(ctx, cfg.quotas, driver)
            self.detector.start_polling(ctx.id, cfg.quotas.poll_interval_s)
            self.bus.emit(
                SandboxEvents.CREATED,
                {
                    "sandbox_id": ctx.id,
                    "driver": ctx.driver,
                    "isolation": list(ctx.isolation),
                    "warnings": list(ctx.warnings),
                },
            )
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        """Forget a destroyed sandbox (``Sandbox.destroy`` calls this)."""
        self._forget(sandbox)

    def _forget(self, sandbox: Sandbox) -> None:
        with self._lock:
            if self._live.get(sandbox.id) is sandbox:
                del self._live[sandbox.id]

    def get(self, sandbox_id: str) -> Sandbox:
        with self._lock:
            sandbox = self._live.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFoundError(sandbox_id)
        return sandbox

    def live_sandboxes(self) -> list[Sandbox]:
        with self._lock:
            return list(self._live.values())

    def cancel(self, sandbox_id: str) -> bool:
        """Kill a running sandbox on behalf of its caller; its run raises SandboxCancelledError."""
        with self._lock:
            sandbox = self._live.get(sandbox_id)
        if sandbox is None:
            return False
        sandbox.cancelled = True
        sandbox.kill()
        return True

    def shutdown(self) -> None:
        """Destroy every live sandbox, then release the drivers' own resources (the Docker
        driver's OOM watcher and warm containers)."""
        for sandbox in self.live_sandboxes():
            try:
                sandbox.destroy()
            except Exception:
                logger.exception("destroying sandbox %s at shutdown failed", sandbox.id)
        with self._lock:
            drivers = list(self._drivers.values())
        for driver in drivers:
            try:
                driver.close()
            except Exception:
                logger.exception("closing the %s driver failed", driver.name)
        if self.store is not None:
            self.store.close()

    # -- runs ---------------------------------------------------------------------------
    def run_in_sandbox(
        self,
        task: Task,
        config: SandboxLifecycleConfig | None = None,
        *,
        stdin: bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        secrets: Mapping[str, bytes | str] | None = None,
    ) -> SandboxOutcome:
        """Run ``task`` in a fresh sandbox and destroy it, whatever happens.

        Returns the outcome when the task ran to its own end (any exit status);
        raises ``SandboxPreFlightError``, ``SandboxTimeoutError``,
        ``QuotaExceededError`` or ``SandboxCancelledError`` (each with ``.outcome``)
        when the sandbox cut it short.
        """
        cfg = config or self.config.sandbox
        if not callable(task):
            cfg = self.config_for(cfg, _argv(task))
        sandbox = self.open_sandbox(cfg, secrets=secrets)
        preflight: list[ExecResult] = []
        try:
            self.run_preflight(sandbox, cfg, preflight)
            idle = cfg.idle_timeout_s
            if callable(task):
                result = task(sandbox)
            else:
                result = sandbox.exec(
                    task,
                    idle_timeout_s=idle,
                    stdin=stdin,
                    on_stdout=on_stdout,
                    on_stderr=on_stderr,
                )
            if result.idle_timed_out:
                self.bus.emit(
                    SandboxEvents.IDLE_TIMEOUT,
                    {"sandbox_id": sandbox.id, "idle_timeout_s": cfg.idle_timeout_s},
                )
            return self._conclude(sandbox, cfg, result, tuple(preflight))
        finally:
            sandbox.destroy()

    def run_preflight(
        self,
        sandbox: Sandbox,
        cfg: SandboxLifecycleConfig | None = None,
        results: list[ExecResult] | None = None,
    ) -> None:
        """Run ``cfg.preflight_commands`` in ``sandbox`` within their own budget; the first
        failure raises ``SandboxPreFlightError`` (``run_in_sandbox`` does this before the
        task; a multi-step session calls it after ``open_sandbox``)."""
        cfg = cfg or sandbox.config
        results = [] if results is None else results
        if not cfg.preflight_commands:
            return
        budget_end = time.monotonic() + cfg.preflight_timeout_s
        for command in cfg.preflight_commands:
            remaining = budget_end - time.monotonic()
            if remaining <= 0:
                self._preflight_failed(
                    sandbox, command, None, "preflight budget exhausted (preflightTimeoutMs)"
                )
            result = sandbox.exec(command, timeout_s=remaining)
            results.append(result)
            if sandbox.timed_out or sandbox.violation is not None or sandbox.cancelled:
                # The whole run was cut short during preflight: report that, not the command.
                self._conclude(sandbox, cfg, result, tuple(results))
            if result.timed_out:
                self._preflight_failed(
                    sandbox,
                    command,
                    result,
                    f"preflight command timed out after {cfg.preflight_timeout_s:g} s "
                    "(sandbox.preflightTimeoutMs)",
                )
            if result.exit_code != 0:
                self._preflight_failed(
                    sandbox, command, result, f"preflight command exited {result.exit_code}"
                )

    def _preflight_failed(
        self, sandbox: Sandbox, command: str, result: ExecResult | None, why: str
    ) -> None:
        self.bus.emit(
            SandboxEvents.PREFLIGHT_FAILED,
            {
                "sandbox_id": sandbox.id,
                "command": command,
                "exit_code": None if result is None else result.exit_code,
            },
        )
        raise SandboxPreFlightError(f"{why}: {command}", command=command, result=result)

    def _final_violation(self, sandbox: Sandbox, result: ExecResult) -> Violation | None:
        """After the task: anything the kernel stopped between two polls is recorded now."""
        v = sandbox.violation
        if v is not None:
            return v
        cfg = sandbox.config
        if result.signal == signal.SIGXFSZ:
            self.detector.enforce_quota(
                Violation(
                    sandbox.id,
                    ViolationType.FILE_SIZE_EXCEEDED,
                    cfg.quotas.max_file_size_bytes + 1,
                    cfg.quotas.max_file_size_bytes,
                    DetectionRule.KERNEL,
                    "a write past RLIMIT_FSIZE raised SIGXFSZ",
                )
            )
            return sandbox.violation
        try:
            metrics = sandbox.driver.get_metrics(sandbox.context)
        except Exception:
            logger.exception("final sample of sandbox %s failed", sandbox.id)
            return None
        verdict = self.detector.evaluate(sandbox.id, metrics, growth=False)
        if verdict.violated:
            self.detector.enforce_quota(verdict)
        return sandbox.violation

    def _conclude(
        self,
        sandbox: Sandbox,
        cfg: SandboxLifecycleConfig,
        result: ExecResult,
        preflight: tuple[ExecResult, ...],
    ) -> SandboxOutcome:
        timed_out = sandbox.timed_out or result.timed_out or result.idle_timed_out
        violation = (
            None if timed_out or sandbox.cancelled else self._final_violation(sandbox, result)
        )
        self.detector.stop_polling(sandbox.id)
        outcome = SandboxOutcome(
            sandbox_id=sandbox.id,
            driver=sandbox.context.driver,
            isolation=sandbox.isolation,
            result=result,
            violation=violation,
            timed_out=timed_out,
            cancelled=sandbox.cancelled,
            preflight=preflight,
            warnings=sandbox.context.warnings,
            node=sandbox.context.node,
        )
        if sandbox.cancelled:
            raise SandboxCancelledError(f"sandbox {sandbox.id} was cancelled", outcome)
        if timed_out:
            idle = result.idle_timed_out and not sandbox.timed_out
            seconds = cfg.idle_timeout_s if idle and cfg.idle_timeout_s else cfg.timeout_s
            raise SandboxTimeoutError(seconds, outcome, idle=idle)
        if violation is not None:
            error = (
                DiskQuotaExceededError(violation, outcome)
                if violation.type == ViolationType.DISK_QUOTA_EXCEEDED
                else QuotaExceededError(violation, outcome)
            )
            self._route_quota_error(sandbox, error)
            raise error
        return outcome

    def _route_quota_error(self, sandbox: Sandbox, error: QuotaExceededError) -> None:
        """Hand the error to a driver with infrastructure to release for it (Docker: a full
        workspace goes to ResourceExhaustionHandler.on_disk_quota_exceeded)."""
        try:
            sandbox.driver.on_quota_exceeded(sandbox.context, error)
        except Exception:
            logger.exception("the %s driver failed to handle %s", sandbox.driver.name, error)

    async def arun_in_sandbox(
        self,
        task: Task,
        config: SandboxLifecycleConfig | None = None,
        **kwargs: Any,
    ) -> SandboxOutcome:
        """Async edge: the run happens on a worker thread (``aio.run_blocking``); cancelling
        this coroutine kills and destroys the sandbox before the CancelledError propagates."""
        cfg = config or self.config.sandbox
        if cfg.sandbox_id is None:
            cfg = override(cfg, sandbox_id=new_sandbox_id())
        sandbox_id = cfg.sandbox_id
        assert sandbox_id is not None
        from devs_sandbox.lifecycle.aio import run_blocking  # noqa: PLC0415 - asyncio, lazily

        return await run_blocking(
            lambda: self.run_in_sandbox(task, cfg, **kwargs),
            on_cancel=lambda: self.cancel(sandbox_id),
            name=f"devs-sandbox-run-{sandbox_id}",
        )

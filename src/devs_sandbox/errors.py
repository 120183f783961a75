"""Every failure devs-sandbox raises, under one root.

Callers catch ``DevsSandboxError`` to handle anything of ours, or a leaf for one
situation. Leaves that describe a run carry its data (``.outcome``,
``.violation``) so that a caller who catches them loses nothing. Several leaves
also inherit the matching builtin, so ``except TimeoutError`` or
``except ValueError`` keeps working for code that knows nothing of this package.

Third-party errors (OSError from the kernel, the Docker SDK's errors, sqlite3)
are translated where they enter, with ``raise ... from exc``.

::

    DevsSandboxError
    +-- ConfigError (ValueError)                 bad config file, option or argument
    |   +-- InvalidSandboxIdError
    |   +-- SecurityConfigError                  a hardening setting was weakened
    |   +-- UntrustedConfigError                 a working directory's config tried to weaken
    +-- IsolationUnavailableError                strict mode: a required mechanism is missing
    |   +-- WeakerIsolationError                 a layer the defaults promise is missing
    +-- DriverError                              the driver's infrastructure failed
    |   +-- DriverUnavailableError               backend not installed or not reachable
    |   +-- ProvisionError                       the sandbox could not be created
    |   |   +-- CapacityError                    the cluster refused it: quota, no room
    |   +-- ImageUnavailableError                no image could be resolved or built
    |   +-- UnsupportedRuntimeError              the driver lacks the runtime a command needs
    |   +-- ExecLostError                        an exec ended without an exit status
    |   +-- SandboxLostError                     its node died or became unreachable mid-run
    +-- SandboxNotFoundError (KeyError)          unknown or already destroyed sandbox id
    +-- SessionLimitError                        the MCP server already keeps mcp.maxSessions alive
    +-- ExecTimeoutError (TimeoutError)          one exec ran past its own timeout
    +-- ResourceLimitExceededError               run_shell_monitored killed a command; .result
    +-- SecretError                              a secret could not be read or injected
    +-- SandboxFileError                         a file could not be read, written or copied out
    +-- StoreError                               the violation store failed
    +-- SandboxRunError                          a run ended abnormally; carries .outcome
        +-- SandboxPreFlightError                a preflight command failed; the task did not run
        +-- SandboxTimeoutError (TimeoutError)   the total timeout fired
        +-- SandboxCancelledError                the run was cancelled by its caller
        +-- QuotaExceededError                   the sandbox was killed for a quota; .violation
        |   +-- DiskQuotaExceededError           the workspace filled up
        +-- SandboxCommandError                  raise_for_status(): the task exited non-zero
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devs_sandbox.models import ExecResult, SandboxOutcome, Violation


class DevsSandboxError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(DevsSandboxError, ValueError):
    """Invalid configuration; ``key`` names the setting or option to change."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class InvalidSandboxIdError(ConfigError):
    """A sandbox id outside ``[A-Za-z0-9._-]{1,64}``; it becomes a path and a cgroup name."""


class SecurityConfigError(ConfigError):
    """A container host config that drops one of the mandatory hardening settings."""


class UntrustedConfigError(ConfigError):
    """A config file found implicitly in the working directory (the workload's, not the
    operator's) set a key that would weaken the sandbox; ``key`` names it, ``path`` the file."""

    def __init__(self, message: str, *, key: str, path: Path) -> None:
        super().__init__(message, key=key)
        self.path = path


class IsolationUnavailableError(DevsSandboxError):
    """Strict mode refused to run because the host lacks a required mechanism."""

    def __init__(self, missing: dict[str, str]) -> None:
        reasons = "; ".join(f"{name}: {why}" for name, why in sorted(missing.items()))
        super().__init__(
            f"required isolation unavailable ({reasons}); "
            "run `devs-sandbox doctor` or relax sandbox.isolation.required"
        )
        self.missing = missing


class WeakerIsolationError(IsolationUnavailableError):
    """A layer every default run promises (namespaces: host read-only, private /tmp, no
    network; the syscall filter) cannot be had here, and the operator did not allow
    weaker isolation: the run is refused rather than silently downgraded."""

    def __init__(self, missing: dict[str, str]) -> None:
        reasons = "; ".join(f"{name}: {why}" for name, why in sorted(missing.items()))
        DevsSandboxError.__init__(
            self,
            f"refusing to run with weaker isolation ({reasons}); run `devs-sandbox doctor`, "
            "or pass --allow-weaker-isolation (sandbox.isolation.allowWeakerIsolation in an "
            "operator config) to run anyway",
        )
        self.missing = missing


class DriverError(DevsSandboxError):
    """The driver could not do its infrastructure work (spawn, mount, cgroup, engine call)."""


class DriverUnavailableError(DriverError):
    """The backend is not installed or cannot be reached (e.g. no Docker engine)."""


class ProvisionError(DriverError):
    """A sandbox could not be created; whatever was made has been torn down."""


class CapacityError(ProvisionError):
    """The backend refused the sandbox for lack of room: a ResourceQuota answered 403
    ("exceeded quota"), or no node can take the pod. Reported at once with the backend's
    reason, never as a timeout; ``reason`` is that text."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class ImageUnavailableError(DriverError):
    """No local image, no registry, no fallback and the rebuild failed."""


class UnsupportedRuntimeError(DriverError):
    """The command needs a runtime (python, node, ...) the driver or image does not provide."""

    def __init__(self, message: str, *, runtime: str, suggested_driver: str | None) -> None:
        super().__init__(message)
        self.runtime = runtime
        self.suggested_driver = suggested_driver


class ExecLostError(DriverError):
    """The exec stream ended without the exit status the protocol promises (a dropped
    connection, a lost frame): an infrastructure failure, never reported as exit 0.
    The exec's processes were killed before this was raised, where the backend allowed."""


class SandboxLostError(DriverError):
    """The node a sandbox was placed on died or stopped answering: the sandbox is gone with
    whatever its command was doing. ``node`` names the node, ``reason`` says what was seen;
    what the sandbox left on the node is reaped there when a node starts again on that host.
    """

    def __init__(self, sandbox_id: str, node: str, reason: str) -> None:
        super().__init__(f"sandbox {sandbox_id} lost with node {node}: {reason}")
        self.sandbox_id = sandbox_id
        self.node = node
        self.reason = reason


class SandboxNotFoundError(DevsSandboxError, KeyError):
    """No live sandbox has this id (never created, or already destroyed); ``detail`` says what
    became of it when that is known (destroyed by whom, expired after which timeout)."""

    def __init__(self, sandbox_id: str, detail: str = "") -> None:
        super().__init__(f"no such sandbox: {sandbox_id!r}" + (f" ({detail})" if detail else ""))
        self.sandbox_id = sandbox_id
        self.detail = detail

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class SessionLimitError(DevsSandboxError):
    """A new sandbox would exceed the most one MCP server keeps alive (``mcp.maxSessions``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"too many sandboxes alive: {limit} (mcp.maxSessions); destroy one with "
            "sandbox_destroy or wait for a run to finish"
        )
        self.limit = limit


class ExecTimeoutError(DevsSandboxError, TimeoutError):
    """``with_execution_timeout`` gave up on one call; the call's work was killed."""

    def __init__(self, timeout_s: float, result: ExecResult | None = None) -> None:
        super().__init__(f"execution exceeded {timeout_s:g} s")
        self.timeout_s = timeout_s
        self.result = result


class ResourceLimitExceededError(DevsSandboxError):
    """A monitored shell command was killed for its RSS or its sustained CPU.

    ``pid`` is the host pid of the command's leader, ``reason`` is ``"rss"`` (``value`` and
    ``limit`` in bytes) or ``"cpu"`` (in percent of one core); ``result`` holds what the
    command printed before the kill, when it got that far.
    """

    def __init__(
        self,
        pid: int,
        reason: str,
        value: float,
        limit: float,
        *,
        result: ExecResult | None = None,
    ) -> None:
        super().__init__(f"Process {pid} exceeded {reason} limit: {value} > {limit}")
        self.pid = pid
        self.reason = reason
        self.value = value
        self.limit = limit
        self.result = result


class SecretError(DevsSandboxError):
    """A secret named on the command line or in config could not be read or delivered."""


class SandboxFileError(DevsSandboxError):
    """A file of a sandbox's workspace could not be read, written, listed or copied out: a
    path outside the workspace (``..``, absolute, a symlink out), a missing file, one over
    the size limit."""


class StoreError(DevsSandboxError):
    """The SQLite violation store could not be opened, migrated or written."""


class SandboxRunError(DevsSandboxError):
    """A run ended abnormally; ``outcome`` holds what it produced up to then."""

    def __init__(self, message: str, outcome: SandboxOutcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


class SandboxPreFlightError(SandboxRunError):
    """A preflight command failed or ran out of its budget; the task never started."""

    def __init__(
        self,
        message: str,
        *,
        command: str,
        result: ExecResult | None,
        outcome: SandboxOutcome | None = None,
    ) -> None:
        super().__init__(message, outcome)
        self.command = command
        self.result = result


class SandboxTimeoutError(SandboxRunError, TimeoutError):
    """The run's total timeout fired; every process of the sandbox was SIGKILLed."""

    def __init__(
        self, timeout_s: float, outcome: SandboxOutcome | None = None, *, idle: bool = False
    ) -> None:
        if idle:
            message = (
                f"sandbox killed after {timeout_s:g} s without output "
                "(raise --idle-timeout or sandbox.idleTimeoutMs)"
            )
        else:
            message = (
                f"sandbox timed out after {timeout_s:g} s (raise --timeout or sandbox.timeoutMs)"
            )
        super().__init__(message, outcome)
        self.timeout_s = timeout_s
        self.idle = idle


class SandboxCancelledError(SandboxRunError):
    """The caller cancelled the run; the sandbox was killed and destroyed."""


class QuotaExceededError(SandboxRunError):
    """The sandbox broke a quota and was terminated; ``violation`` says which."""

    def __init__(self, violation: Violation, outcome: SandboxOutcome | None = None) -> None:
        super().__init__(
            f"sandbox {violation.sandbox_id} terminated: {violation.type} "
            f"(observed {violation.observed_value}, limit {violation.limit_value})",
            outcome,
        )
        self.violation = violation


class DiskQuotaExceededError(QuotaExceededError):
    """The workspace ran out of space or inodes."""


class SandboxCommandError(SandboxRunError):
    """Raised by ``outcome.raise_for_status()`` when the task exited non-zero."""

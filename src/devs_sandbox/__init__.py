"""devs-sandbox: ephemeral, resource-capped sandboxes for AI coding agents.

Public API (everything else is importable but not promised)::

    from devs_sandbox import SandboxLifecycleManager, SandboxLifecycleConfig

    manager = SandboxLifecycleManager()
    outcome = manager.run_in_sandbox(["python3", "-c", "print(1)"], SandboxLifecycleConfig())
    print(outcome.exit_code, outcome.result.stdout.text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module defining it. Resolved on first access (PEP 562), so that
# `import devs_sandbox` (and the CLI, which imports a submodule of it) pays only for what
# it uses: the Docker SDK, psutil, asyncio and the MCP stack load when something needs them.
_EXPORTS: dict[str, str] = {
    "CapturedStream": "devs_sandbox.models",
    "ConfigError": "devs_sandbox.errors",
    "DetectionRule": "devs_sandbox.models",
    "DevsConfig": "devs_sandbox.config",
    "DevsSandboxError": "devs_sandbox.errors",
    "DiskQuotaExceededError": "devs_sandbox.errors",
    "DockerConfig": "devs_sandbox.config",
    "DriverError": "devs_sandbox.errors",
    "DriverUnavailableError": "devs_sandbox.errors",
    "EnvironmentSanitizer": "devs_sandbox.security.environment",
    "EventBus": "devs_sandbox.events",
    "ExecResult": "devs_sandbox.models",
    "ExecTimeoutError": "devs_sandbox.errors",
    "FakeDriver": "devs_sandbox.drivers.fake",
    "FakeScheduler": "devs_sandbox.scheduler",
    "FilesystemQuotaConfig": "devs_sandbox.monitors.drain",
    "ImageUnavailableError": "devs_sandbox.errors",
    "InvalidSandboxIdError": "devs_sandbox.errors",
    "IsolationConfig": "devs_sandbox.config",
    "IsolationUnavailableError": "devs_sandbox.errors",
    "MonitoredShellOptions": "devs_sandbox.tools.shell",
    "ProcessDriver": "devs_sandbox.drivers.process",
    "ProcessQuotaConfig": "devs_sandbox.monitors.drain",
    "ProvisionError": "devs_sandbox.errors",
    "PsutilProcessStats": "devs_sandbox.lifecycle.sampling",
    "QuotaConfig": "devs_sandbox.config",
    "QuotaExceededError": "devs_sandbox.errors",
    "QuotaViolation": "devs_sandbox.monitors.drain",
    "Redactor": "devs_sandbox.security.session_keys",
    "ResourceDrainDetector": "devs_sandbox.lifecycle.watchdog",
    "ResourceExhaustionHandler": "devs_sandbox.exhaustion",
    "ResourceLimitExceededError": "devs_sandbox.errors",
    "ResourceUsage": "devs_sandbox.models",
    "RuntimeCompatibilityChecker": "devs_sandbox.runtimes",
    "Sandbox": "devs_sandbox.lifecycle",
    "SandboxCancelledError": "devs_sandbox.errors",
    "SandboxCommandError": "devs_sandbox.errors",
    "SandboxContext": "devs_sandbox.models",
    "SandboxEvents": "devs_sandbox.events",
    "SandboxLifecycleConfig": "devs_sandbox.config",
    "SandboxLifecycleManager": "devs_sandbox.lifecycle",
    "SandboxManager": "devs_sandbox.exhaustion",
    "SandboxMetrics": "devs_sandbox.models",
    "SandboxNotFoundError": "devs_sandbox.errors",
    "SandboxOutcome": "devs_sandbox.models",
    "SandboxPreFlightError": "devs_sandbox.errors",
    "SandboxRunError": "devs_sandbox.errors",
    "SandboxSessions": "devs_sandbox.tools.sessions",
    "SandboxTimeoutEnforcer": "devs_sandbox.lifecycle.timeout",
    "SandboxTimeoutError": "devs_sandbox.errors",
    "ScriptedProcessStats": "devs_sandbox.lifecycle.sampling",
    "SecretError": "devs_sandbox.errors",
    "SecurityConfigError": "devs_sandbox.errors",
    "SessionKeyManager": "devs_sandbox.security.session_keys",
    "SessionLimitError": "devs_sandbox.errors",
    "ShellResult": "devs_sandbox.tools.shell",
    "StoreError": "devs_sandbox.errors",
    "ThreadScheduler": "devs_sandbox.scheduler",
    "TreeSample": "devs_sandbox.models",
    "UnsupportedRuntimeError": "devs_sandbox.errors",
    "Violation": "devs_sandbox.models",
    "ViolationStore": "devs_sandbox.store",
    "ViolationType": "devs_sandbox.models",
    "awith_execution_timeout": "devs_sandbox.lifecycle.timeout",
    "check_filesystem_quota": "devs_sandbox.monitors.drain",
    "check_process_quota": "devs_sandbox.monitors.drain",
    "default_timeout_enforcer": "devs_sandbox.lifecycle.timeout",
    "load_config": "devs_sandbox.config",
    "override": "devs_sandbox.config",
    "run_shell_monitored": "devs_sandbox.tools.shell",
    "run_shell_monitored_sync": "devs_sandbox.tools.shell",
    "session_key_manager": "devs_sandbox.security.session_keys",
    "with_execution_timeout": "devs_sandbox.lifecycle.timeout",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devs_sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # the names as static imports, for type checkers and IDEs
    from devs_sandbox.config import (
        DevsConfig,
        DockerConfig,
        IsolationConfig,
        QuotaConfig,
        SandboxLifecycleConfig,
        load_config,
        override,
    )
    from devs_sandbox.drivers.fake import FakeDriver
    from devs_sandbox.drivers.process import ProcessDriver
    from devs_sandbox.errors import (
        ConfigError,
        DevsSandboxError,
        DiskQuotaExceededError,
        DriverError,
        DriverUnavailableError,
        ExecTimeoutError,
        ImageUnavailableError,
        InvalidSandboxIdError,
        IsolationUnavailableError,
        ProvisionError,
        QuotaExceededError,
        ResourceLimitExceededError,
        SandboxCancelledError,
        SandboxCommandError,
        SandboxNotFoundError,
        SandboxPreFlightError,
        SandboxRunError,
        SandboxTimeoutError,
        SecretError,
        SecurityConfigError,
        SessionLimitError,
        StoreError,
        UnsupportedRuntimeError,
    )
    from devs_sandbox.events import EventBus, SandboxEvents
    from devs_sandbox.exhaustion import ResourceExhaustionHandler, SandboxManager
    from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
    from devs_sandbox.lifecycle.sampling import PsutilProcessStats, ScriptedProcessStats
    from devs_sandbox.lifecycle.timeout import (
        SandboxTimeoutEnforcer,
        awith_execution_timeout,
        default_timeout_enforcer,
        with_execution_timeout,
    )
    from devs_sandbox.lifecycle.watchdog import ResourceDrainDetector
    from devs_sandbox.models import (
        CapturedStream,
        DetectionRule,
        ExecResult,
        ResourceUsage,
        SandboxContext,
        SandboxMetrics,
        SandboxOutcome,
        TreeSample,
        Violation,
        ViolationType,
    )
    from devs_sandbox.monitors.drain import (
        FilesystemQuotaConfig,
        ProcessQuotaConfig,
        QuotaViolation,
        check_filesystem_quota,
        check_process_quota,
    )
    from devs_sandbox.runtimes import RuntimeCompatibilityChecker
    from devs_sandbox.scheduler import FakeScheduler, ThreadScheduler
    from devs_sandbox.security.environment import EnvironmentSanitizer
    from devs_sandbox.security.session_keys import Redactor, SessionKeyManager, session_key_manager
    from devs_sandbox.store import ViolationStore
    from devs_sandbox.tools.sessions import SandboxSessions
    from devs_sandbox.tools.shell import (
        MonitoredShellOptions,
        ShellResult,
        run_shell_monitored,
        run_shell_monitored_sync,
    )

__all__ = [
    "CapturedStream",
    "ConfigError",
    "DetectionRule",
    "DevsConfig",
    "DevsSandboxError",
    "DiskQuotaExceededError",
    "DockerConfig",
    "DriverError",
    "DriverUnavailableError",
    "EnvironmentSanitizer",
    "EventBus",
    "ExecResult",
    "ExecTimeoutError",
    "FakeDriver",
    "FakeScheduler",
    "FilesystemQuotaConfig",
    "ImageUnavailableError",
    "InvalidSandboxIdError",
    "IsolationConfig",
    "IsolationUnavailableError",
    "MonitoredShellOptions",
    "ProcessDriver",
    "ProcessQuotaConfig",
    "ProvisionError",
    "PsutilProcessStats",
    "QuotaConfig",
    "QuotaExceededError",
    "QuotaViolation",
    "Redactor",
    "ResourceDrainDetector",
    "ResourceExhaustionHandler",
    "ResourceLimitExceededError",
    "ResourceUsage",
    "RuntimeCompatibilityChecker",
    "Sandbox",
    "SandboxCancelledError",
    "SandboxCommandError",
    "SandboxContext",
    "SandboxEvents",
    "SandboxLifecycleConfig",
    "SandboxLifecycleManager",
    "SandboxManager",
    "SandboxMetrics",
    "SandboxNotFoundError",
    "SandboxOutcome",
    "SandboxPreFlightError",
    "SandboxRunError",
    "SandboxSessions",
    "SandboxTimeoutEnforcer",
    "SandboxTimeoutError",
    "ScriptedProcessStats",
    "SecretError",
    "SecurityConfigError",
    "SessionKeyManager",
    "SessionLimitError",
    "ShellResult",
    "StoreError",
    "ThreadScheduler",
    "TreeSample",
    "UnsupportedRuntimeError",
    "Violation",
    "ViolationStore",
    "ViolationType",
    "__version__",
    "awith_execution_timeout",
    "check_filesystem_quota",
    "check_process_quota",
    "default_timeout_enforcer",
    "load_config",
    "override",
    "run_shell_monitored",
    "run_shell_monitored_sync",
    "session_key_manager",
    "with_execution_timeout",
]

"""devs-sandbox: ephemeral, resource-capped sandboxes for AI coding agents.

Public API (everything else is importable but not promised)::

    from devs_sandbox import SandboxLifecycleManager, SandboxLifecycleConfig

    manager = SandboxLifecycleManager()
    outcome = manager.run_in_sandbox(["python3", "-c", "print(1)"], SandboxLifecycleConfig())
    print(outcome.exit_code, outcome.result.stdout.text)
"""

# Public name -> the module defining it, resolved on first access (PEP 562): importing
# `devs_sandbox` or one of its modules (the CLI's entry point imports one on every call)
# costs next to nothing; the Docker SDK, psutil, asyncio, pydantic and the MCP stack load
# when something needs them. No import here at all, not even typing: type checkers read
# the names from __init__.pyi.
__version__ = "0.1.0"

_EXPORTS = {
    "CapacityError": "devs_sandbox.errors",
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
    "ExecLostError": "devs_sandbox.errors",
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
    "SandboxFileError": "devs_sandbox.errors",
    "SandboxLostError": "devs_sandbox.errors",
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
    "load_config": "devs_sandbox.config_trust",
    "override": "devs_sandbox.config",
    "run_shell_monitored": "devs_sandbox.tools.shell",
    "run_shell_monitored_sync": "devs_sandbox.tools.shell",
    "session_key_manager": "devs_sandbox.security.session_keys",
    "with_execution_timeout": "devs_sandbox.lifecycle.timeout",
}


def __getattr__(name):  # type: ignore[no-untyped-def]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devs_sandbox' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__():  # type: ignore[no-untyped-def]
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "CapacityError",
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
    "ExecLostError",
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
    "SandboxFileError",
    "SandboxLifecycleConfig",
    "SandboxLifecycleManager",
    "SandboxLostError",
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

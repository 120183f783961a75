"""Type information for the lazy public API of ``__init__.py`` (the same names)."""

from devs_sandbox.config import (
    DevsConfig,
    DockerConfig,
    IsolationConfig,
    QuotaConfig,
    SandboxLifecycleConfig,
    override,
)
from devs_sandbox.config_trust import load_config
from devs_sandbox.drivers.fake import FakeDriver
from devs_sandbox.drivers.process import ProcessDriver
from devs_sandbox.errors import (
    CapacityError,
    ConfigError,
    DevsSandboxError,
    DiskQuotaExceededError,
    DriverError,
    DriverUnavailableError,
    ExecLostError,
    ExecTimeoutError,
    ImageUnavailableError,
    InvalidSandboxIdError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    ResourceLimitExceededError,
    SandboxCancelledError,
    SandboxCommandError,
    SandboxFileError,
    SandboxLostError,
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
from devs_sandbox.tools.code import run_code
from devs_sandbox.tools.sessions import SandboxSessions
from devs_sandbox.tools.shell import (
    MonitoredShellOptions,
    ShellResult,
    run_shell_monitored,
    run_shell_monitored_sync,
)

__version__: str
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
    "run_code",
    "run_shell_monitored",
    "run_shell_monitored_sync",
    "session_key_manager",
    "with_execution_timeout",
]

"""The lifecycle: config -> manager -> driver, watched by the watchdogs, told to the bus.

``SandboxLifecycleManager`` opens a fresh sandbox per run through the configured driver,
arms its total timeout (``SandboxTimeoutEnforcer``) and its resource watchdog
(``ResourceDrainDetector``, which asks the pure policies of ``monitors/``), decides the
run's outcome and destroys the sandbox on every exit path. ``Sandbox`` is one live
sandbox; ``aio.run_blocking`` is the one asyncio edge.
"""

from devs_sandbox.lifecycle.manager import SandboxLifecycleManager, Task
from devs_sandbox.lifecycle.sandbox import Sandbox
from devs_sandbox.lifecycle.timeout import SandboxTimeoutEnforcer
from devs_sandbox.lifecycle.watchdog import ResourceDrainDetector, ShellMonitor

__all__ = [
    "ResourceDrainDetector",
    "Sandbox",
    "SandboxLifecycleManager",
    "SandboxTimeoutEnforcer",
    "ShellMonitor",
    "Task",
]

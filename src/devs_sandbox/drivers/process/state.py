"""The process driver's state of one sandbox, and the plan it was provisioned from."""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.linux import HOST_MECHANISMS
from devs_sandbox.isolation.cgroups import SandboxCgroup
from devs_sandbox.security.session_keys import Redactor
from devs_sandbox.workspace import WorkspaceScanner

WORKSPACE_PREFIX: Final = "devs-sandbox-"
SECRETS_DIR_IN_WORKSPACE: Final = ".devs-secrets"  # without namespaces: in the workspace
MECHANISMS: Final = HOST_MECHANISMS
NAMESPACES: Final = ("pid-namespace", "mount-namespace", "net-namespace")
# What a default run promises (host read-only with private /tmp, no network or an isolated
# one, kernel surfaces filtered): provided by bwrap or by our unshare launcher, or the run
# is refused unless the operator allowed weaker isolation.
PROMISED: Final = (*NAMESPACES, "seccomp")


@dataclass(frozen=True, slots=True)
class Plan:
    """Which mechanism provides each layer of one sandbox here."""

    report: dict[str, str]  # mechanism -> "" when in effect, else why not
    launcher: str | None  # "bwrap", "unshare", or None without namespaces
    bwrap_path: str | None
    network: str  # "none" (own namespace, no route), "pasta", or "host"
    limit_fallbacks: tuple[str, ...] = ()  # how limits hold without a cgroup

    def warnings(self) -> tuple[str, ...]:
        """One entry per default layer not in effect, with the reason."""
        out = [f"{m}: {why}" for m, why in self.report.items() if why]
        if self.network == "host":
            out.append("network: the sandbox shares the host's network namespace")
        if self.report.get("cgroup"):
            out += self.limit_fallbacks
        return tuple(out)


@dataclass
class Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    config: SandboxLifecycleConfig
    workspace: Path
    uid: int
    gid: int
    isolation: tuple[str, ...]
    root: Path = field(default=Path())  # the sandbox's private root: workspace, tmp, shm
    cgroup: SandboxCgroup | None = None
    mounted: bool = False
    launcher: str | None = None  # "bwrap", "unshare", or None without namespaces
    bwrap_path: str | None = None
    network: str = "none"  # "none" (own namespace, no route), "pasta", or "host"
    base_inodes: int = 0  # inodes of the root's structure, not counted as the task's
    secrets_placed: bool = False  # written once into the tmpfs root (else per exec)
    warnings: tuple[str, ...] = ()
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    peak_processes: int = 0
    stops: int = 0  # force_stop calls so far: a launch killed by one is never retried
    lock: threading.Lock = field(default_factory=threading.Lock)
    scanner: WorkspaceScanner | None = None
    secrets: dict[str, bytearray] = field(default_factory=dict)
    redactor: Redactor | None = None
    leased: bool = False  # what this provision made, so a failed one undoes only that
    made_workspace: bool = False
    secret_paths: dict[str, str] = field(default_factory=dict)
    base_env: dict[str, str] | None = None  # computed once: host env is read at provision

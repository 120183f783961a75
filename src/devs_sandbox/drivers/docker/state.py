"""Names, labels and the live state of one container sandbox, and the host-side view of
its processes (by pid and pidfd, under /proc)."""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.images import ResolvedImage
from devs_sandbox.isolation.cgroups import CgroupCounters, SandboxCgroup
from devs_sandbox.leases import Owner
from devs_sandbox.security.session_keys import Redactor
from devs_sandbox.workspace import WorkspaceScanner

# -- names ------------------------------------------------------------------------------
CONTAINER_PREFIX: Final = "devs-sandbox-"
HOST_DIR_PREFIX: Final = "devs-sandbox-"
WORKSPACE: Final = "/workspace"
TMP: Final = "/tmp"
LABEL_MANAGED: Final = "devs.managed"
LABEL_SANDBOX: Final = "devs.sandbox.id"
LABEL_OWNER_PID: Final = "devs.owner.pid"
LABEL_OWNER_START: Final = "devs.owner.start"
LABEL_OWNER_BOOT: Final = "devs.owner.boot"
LABEL_POOL: Final = "devs.pool"  # configuration hash of a warm container

# -- timings ----------------------------------------------------------------------------
EXEC_START_TIMEOUT_S: Final = 10.0  # until the engine reports the exec's pid; a loaded
# 2-core host takes tens of ms, so this only bounds a wedged engine
STOP_WAIT_S: Final = 5.0  # after SIGKILL to init the kernel empties the pid namespace in ms
REMOVE_FLUSH_S: Final = 60.0  # close() waits this long for background removals


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a container is created from, apart from its id-specific names."""

    config: SandboxLifecycleConfig
    image: ResolvedImage
    user: str
    uid: int | None
    gid: int | None
    host_config: dict[str, Any]
    env: dict[str, str]
    shape: str  # hash of all of the above that matters to a warm pool


@dataclass
class Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    plan: Plan
    host_dir: Path
    isolation: tuple[str, ...]
    container_id: str = ""
    init_pid: int | None = None
    init_pidfd: int | None = None
    launcher_pid: int | None = None
    launcher_sock: socket.socket | None = None
    launcher_keep: Any = None  # the SDK object owning launcher_sock: keep it from the GC
    cgroup: SandboxCgroup | None = None
    exec_parent: dict[str, Path] | None = None
    scanner: WorkspaceScanner | None = None
    last: CgroupCounters = field(default_factory=CgroupCounters)
    oom_events: int = 0
    peak_processes: int = 0
    exec_seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    exec_cgroups: list[SandboxCgroup] = field(default_factory=list)
    leased: bool = False  # what this provision made, so a failed one undoes only that
    made_dir: bool = False
    container_removed: bool = False  # the exhaustion handler removed it: destroy does not again
    secrets: dict[str, bytearray] = field(default_factory=dict)
    redactor: Redactor | None = None
    secret_env: dict[str, str] = field(default_factory=dict)
    secrets_pending: bool = False  # written by the first exec (through the launcher if it can)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return f"{CONTAINER_PREFIX}{self.id}"

    @property
    def config(self) -> SandboxLifecycleConfig:
        return self.plan.config


@dataclass
class Exec:
    sock: socket.socket
    pid: int
    exec_id: str | None  # None: through the launcher
    nonce: str | None
    cgroup: SandboxCgroup | None
    pidfd: int | None = None
    keep: Any = None  # the SDK object owning sock: keep it from the GC


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        pass
    found: list[int] = []  # kernels without CONFIG_PROC_CHILDREN: scan for the parent pid
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry.name))
    return found


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def exited(fd: int | None, timeout_s: float = 0.0) -> bool:
    """Whether the process behind pidfd ``fd`` has exited (waiting up to ``timeout_s``)."""
    if fd is None:
        return False
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
    except (OSError, ValueError):  # closed by a concurrent destroy: the sandbox is gone
        return True
    return bool(readable)


def wait_child(pid: int, timeout_s: float) -> int | None:
    """The first child of ``pid``, waiting up to ``timeout_s`` for one to appear."""
    end = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        kids = children(pid)
        if kids:
            return kids[0]
        if time.monotonic() >= end:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def is_container_pid(pid: int, container_id: str) -> bool:
    try:
        return container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def owner_from_labels(labels: Mapping[str, Any]) -> Owner:
    try:
        pid = int(labels.get(LABEL_OWNER_PID) or 0)
    except ValueError:
        pid = 0
    start_raw = str(labels.get(LABEL_OWNER_START) or "")
    start = int(start_raw) if start_raw.isdigit() else None
    return Owner(pid, start, str(labels.get(LABEL_OWNER_BOOT) or ""))

"""The Docker driver: one hardened container per sandbox, on a real engine, through the SDK.

Hardening lives in one place. ``build_host_config`` makes every runtime
HostConfig (CapDrop ALL, no-new-privileges, unprivileged, read-only root, init,
memory with an equal memory-swap, pids limit, CPU quota, no network unless asked,
size- and inode-limited tmpfs workspace, nofile/nproc/fsize/core ulimits, no
json log to fill the host disk), and ``validate_host_config`` rejects any
deviation with ``SecurityConfigError`` right before the create call, whoever
built or amended the config (``host_config_overrides``).

Layout of a sandbox::

    docker-init (pid 1, reaps zombies)
      `-- /bin/sh launcher   (container's stdin, attached by us; serves one request)
    /workspace   tmpfs size=diskBytes nr_inodes=fileCountLimit+1, the working directory
    /tmp         tmpfs size=docker.tmpBytes
    <tmp>/devs-sandbox-<id>/   host side: the copy-in spool and the container id

How a command runs. The first exec that needs no stdin goes through the
launcher: we write one request line (a nonce and a POSIX-quoted command) on its
stdin; it forks a subshell that waits for "go"; we move that subshell into a
cgroup of its own, say "go", and it execs the command; when the command ends the
launcher writes ``\\0devs-exit:<nonce>:<status>\\0`` on stdout and stderr. That
skips the engine's ``runc exec`` (about 45 ms here): a one-shot run costs one
create, start and remove. Every other exec is a ``docker exec`` of the same shim
the process driver uses (wait for "go", then exec), so it too is moved into its
own cgroup before it runs. Either way no output can arrive before we read the
raw stream, and a per-call timeout freezes and SIGKILLs that cgroup: the exec's
whole tree, setsid'd grandchildren included, and nothing else. (The engine has
no API to kill an exec; killing its pid alone would miss the grandchildren.)
Without a writable cgroup tree (not root), a per-call timeout kills the whole
container instead, and ``isolation_report`` says so.

Observation reads the container's cgroup files (memory, pids.events, cpuacct,
memory.oom_control) and its workspace through ``/proc/<init pid>/root``; init is
held by a pidfd, so a recycled pid is never signalled. OOM kills arrive pushed by
the engine (``exhaustion.SandboxManager``), and are remembered here before the
handler removes the container, so the metrics keep reporting them.

Invariant: ``destroy`` leaves no container, host directory, cgroup or lease; it
is idempotent, works after a partial ``provision`` (by name) and is bounded by
the engine timeout. Every container carries ``devs.managed=true``, its sandbox id
and its owner (pid, start time, boot id), so ``reap_orphans`` finds it even if
the lease file is lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import secrets
import select
import shutil
import signal
import socket
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.process import (
    DEFAULT_PATH,
    MAX_SIGNAL,
    SHIM,
    SHIM_NAME,
)
from devs_sandbox.drivers.process import MECHANISMS as PROCESS_MECHANISMS
from devs_sandbox.engine import (
    ENGINE_TIMEOUT_S,
    connect,
    docker_sdk,
    engine_errors,
    is_not_found,
)
from devs_sandbox.errors import (
    DevsSandboxError,
    DiskQuotaExceededError,
    DriverError,
    DriverUnavailableError,
    ImageUnavailableError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    SandboxNotFoundError,
    SecurityConfigError,
)
from devs_sandbox.exhaustion import DockerOomEvents, ResourceExhaustionHandler, SandboxManager
from devs_sandbox.images import ImageResolver, ResolvedImage
from devs_sandbox.isolation import NOBODY_GID, NOBODY_UID
from devs_sandbox.isolation.cgroups import (
    CgroupCounters,
    CgroupSupport,
    SandboxCgroup,
    cgroup_dirs_of,
    detect,
)
from devs_sandbox.leases import Lease, LeaseRegistry, Owner
from devs_sandbox.models import (
    ENV_NAME,
    ExecResult,
    ResourceUsage,
    SandboxContext,
    SandboxMetrics,
    new_sandbox_id,
    validate_sandbox_id,
)
from devs_sandbox.security.session_keys import Redactor, validate_secrets, wipe
from devs_sandbox.workspace import WorkspaceScanner

if TYPE_CHECKING:
    from docker import DockerClient

logger = logging.getLogger(__name__)

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

# -- limits and timings -----------------------------------------------------------------
INFRA_PROCESSES: Final = 2  # docker-init and the launcher: not the task's, not counted
NPROC_BACKSTOP_FACTOR: Final = 4  # RLIMIT_NPROC is per uid host-wide: equal to the pids
# limit, one sandbox's fork bomb would starve every other sandbox running as nobody
CPU_PERIOD_US: Final = 100_000
EXEC_START_TIMEOUT_S: Final = 10.0  # until the engine reports the exec's pid; a loaded
# 2-core host takes tens of ms, so this only bounds a wedged engine
LAUNCHER_TRAILER_WAIT_S: Final = 5.0  # after the task exits the launcher writes at once
EXIT_STATUS_WAIT_S: Final = 5.0  # until exec_inspect reports an exited exec's status
STOP_WAIT_S: Final = 5.0  # after SIGKILL to init the kernel empties the pid namespace in ms
CD_SHIM: Final = 'cd -- "$0" || exit 1; exec "$@"'
ENGINE_POLL_S: Final = 0.05  # exit polling through exec_inspect (an API round trip) without pidfds
POOL_FILL_BACKOFF_S: Final = 5.0  # after a failed warm-container create
POOL_MAX_SHAPES: Final = 4  # configurations kept warm at once; the least recent is dropped
REMOVE_FLUSH_S: Final = 60.0  # close() waits this long for background removals
COPY_SPOOL_BYTES: Final = 8 * 1024 * 1024  # copy-in tar kept in memory below this
SECRETS_DIR: Final = "/tmp/.devs-secrets"  # in the container's private /tmp tmpfs
# Writes stdin to $SECRETS_DIR/$1, 0400, in a 0500 directory (made writable for the
# moment of the write only).
SECRET_WRITER: Final = (
    f'd={SECRETS_DIR}; mkdir -p "$d" && chmod 0700 "$d" && '
    '(umask 0277 && cat > "$d/$1") && chmod 0500 "$d"'
)

# The only settings a HostConfig may not drop; ``validate_host_config`` checks more.
MANDATORY_HOST_CONFIG: Final[Mapping[str, Any]] = {
    "CapDrop": ["ALL"],
    "SecurityOpt": ["no-new-privileges:true"],
    "Privileged": False,
}
# Host resources a sandbox must never be handed, whatever an override says.
_FORBIDDEN_KEYS: Final = (
    "Binds",
    "Mounts",
    "VolumesFrom",
    "Devices",
    "DeviceCgroupRules",
    "DeviceRequests",
    "Sysctls",
    "Links",
)
_HOST_NAMESPACE_KEYS: Final = ("PidMode", "IpcMode", "UTSMode", "UsernsMode", "CgroupnsMode")

# The process driver's mechanisms (same names, same meaning), then the engine's own.
MECHANISMS: Final = (
    *PROCESS_MECHANISMS,
    "cap-drop-all",
    "no-new-privileges",
    "read-only-rootfs",
    "seccomp",
    "exec-cgroup",
)

# The container's main process, under docker-init. It serves at most one request and
# then holds the container up: stdin stays open (StdinOnce false) after we detach. The
# request is "<nonce> <sh snippet>"; $N is a newline for arguments that contain one.
LAUNCHER: Final = r"""N='
'
IFS=' ' read -r nonce cmd || exit 0
( IFS= read -r _ || exit 125; eval "$cmd" )
st=$?
printf '\000devs-exit:%s:%03d\000' "$nonce" "$st"
printf '\000devs-exit:%s:%03d\000' "$nonce" "$st" >&2
while IFS= read -r _; do :; done
"""
LAUNCHER_NAME: Final = "devs-sandbox-launcher"
_TRAILER_TAG: Final = b"\0devs-exit:"
_TRAILER_STATUS_LEN: Final = 4  # three digits and the closing NUL


# -- hardening ----------------------------------------------------------------------------
def _tmpfs_options(size_bytes: int, inodes: int, uid: int | None, gid: int | None) -> str:
    # Docker adds noexec to tmpfs mounts by default: a workspace must run what it builds.
    opts = f"rw,exec,nosuid,nodev,size={size_bytes},nr_inodes={inodes}"
    if uid is None or gid is None:
        return opts + ",mode=1777"
    return opts + f",mode=0700,uid={uid},gid={gid}"


# REQ: 8_RISKS-REQ-123
def build_host_config(
    config: SandboxLifecycleConfig,
    *,
    uid: int | None = NOBODY_UID,
    gid: int | None = NOBODY_GID,
    pids_limit_supported: bool = True,
) -> dict[str, Any]:
    """The runtime HostConfig (Docker API field names) of a sandbox for ``config``.

    ``uid``/``gid`` own the workspace tmpfs (None: the image's user is a name we cannot
    resolve, so the workspace is world-writable with the sticky bit instead).
    """
    q = config.quotas
    pids_limit = q.process_count_limit + INFRA_PROCESSES
    nproc = pids_limit * (NPROC_BACKSTOP_FACTOR if pids_limit_supported else 1)
    hc: dict[str, Any] = {
        **{k: (list(v) if isinstance(v, list) else v) for k, v in MANDATORY_HOST_CONFIG.items()},
        "ReadonlyRootfs": True,
        "Init": True,
        "Memory": q.memory_bytes,
        "MemorySwap": q.memory_bytes,  # equal: no swap to escape the memory cap into
        "OomKillDisable": False,
        "PidsLimit": pids_limit,
        "NetworkMode": "bridge" if config.network else "none",
        "IpcMode": "private",
        # Its own cgroup namespace: the engine's default on cgroup v1 hosts is the host's,
        # where /proc/self/cgroup names the container's (and so the sandbox's) engine path.
        "CgroupnsMode": "private",
        # /dev/shm is a tmpfs of its own, sized like /tmp and charged to the memory cap.
        "ShmSize": config.docker.tmp_bytes,
        "Tmpfs": {
            WORKSPACE: _tmpfs_options(q.disk_bytes, q.file_count_limit + 1, uid, gid),
            TMP: _tmpfs_options(config.docker.tmp_bytes, q.file_count_limit + 1, None, None),
        },
        "Ulimits": [
            {"Name": "nofile", "Soft": q.max_open_files, "Hard": q.max_open_files},
            {"Name": "nproc", "Soft": nproc, "Hard": nproc},
            {"Name": "fsize", "Soft": q.max_file_size_bytes, "Hard": q.max_file_size_bytes},
            {"Name": "core", "Soft": 0, "Hard": 0},
        ],
        # The json-file log grows without bound on the host disk (an output flood of 64 MiB
        # grew it by 68 MiB); we read output from the attach stream, never from logs.
        "LogConfig": {"Type": "none", "Config": {}},
        "RestartPolicy": {"Name": "no"},
        "AutoRemove": False,
    }
    if q.cpu_cores is not None:
        hc["CpuPeriod"] = CPU_PERIOD_US
        hc["CpuQuota"] = max(1000, int(q.cpu_cores * CPU_PERIOD_US))
    return hc


def _secopt(option: str) -> tuple[str, str]:
    name, _, value = option.replace("=", ":", 1).partition(":")
    return name.strip().lower(), value.strip().lower()


def validate_host_config(hc: Mapping[str, Any], *, network_allowed: bool = False) -> None:
    """Raise ``SecurityConfigError`` naming every setting that weakens the sandbox.

    Checked right before each create, on the final dict, so no caller, override or
    future code path can hand the engine a config without the hardening.
    """
    problems: list[tuple[str, str]] = []

    def bad(key: str, why: str) -> None:
        problems.append((key, why))

    if hc.get("Privileged") is not False:
        bad("Privileged", "must be false")
    cap_drop = hc.get("CapDrop")
    if not isinstance(cap_drop, list) or [str(c).upper() for c in cap_drop] != ["ALL"]:
        bad("CapDrop", 'must be ["ALL"]')
    if hc.get("CapAdd"):
        bad("CapAdd", "must be empty: every capability stays dropped")
    secopts = hc.get("SecurityOpt")
    parsed = [_secopt(str(o)) for o in secopts] if isinstance(secopts, list) else []
    if ("no-new-privileges", "true") not in parsed and ("no-new-privileges", "") not in parsed:
        bad("SecurityOpt", 'must contain "no-new-privileges:true"')
    for name, value in parsed:
        if name in {"seccomp", "apparmor", "systempaths"} and value == "unconfined":
            bad("SecurityOpt", f"{name}=unconfined is not allowed")
        if name == "label" and value == "disable":
            bad("SecurityOpt", "label=disable is not allowed")
        if name == "no-new-privileges" and value == "false":
            bad("SecurityOpt", "no-new-privileges:false is not allowed")
    if hc.get("ReadonlyRootfs") is not True:
        bad("ReadonlyRootfs", "must be true")
    if hc.get("Init") is not True:
        bad("Init", "must be true (an init reaps zombies and forwards signals)")
    memory = hc.get("Memory")
    if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
        bad("Memory", "must be a positive byte count")
    elif hc.get("MemorySwap") != memory:
        bad("MemorySwap", "must equal Memory (no swap escape)")
    if hc.get("OomKillDisable"):
        bad("OomKillDisable", "must be false")
    pids = hc.get("PidsLimit")
    if not isinstance(pids, int) or isinstance(pids, bool) or pids <= 0:
        bad("PidsLimit", "must be a positive number")
    network = str(hc.get("NetworkMode") or "")
    if network == "host" or network.startswith("container:"):
        bad("NetworkMode", f"{network} shares a namespace with the host or another container")
    elif not network_allowed and network != "none":
        bad("NetworkMode", 'must be "none" unless the sandbox asked for network')
    for key in _HOST_NAMESPACE_KEYS:
        value = str(hc.get(key) or "")
        if value == "host" or value.startswith("container:"):
            bad(key, f"{value} shares a namespace with the host or another container")
    if hc.get("CgroupnsMode") != "private":
        bad("CgroupnsMode", "must be \"private\" (the host's names every container's cgroup)")
    for key in _FORBIDDEN_KEYS:
        if hc.get(key):
            bad(key, "host paths, devices and kernel settings are never passed to a sandbox")
    for key in ("MaskedPaths", "ReadonlyPaths"):
        if key in hc:
            bad(key, "must be left to the engine's defaults (an empty list unmasks /proc)")
    tmpfs = hc.get("Tmpfs")
    workspace = tmpfs.get(WORKSPACE) if isinstance(tmpfs, Mapping) else None
    if not isinstance(workspace, str) or "size=" not in workspace:
        bad("Tmpfs", f"must mount a size-limited tmpfs on {WORKSPACE}")
    ulimits = hc.get("Ulimits")
    names = {str(u.get("Name")) for u in ulimits if isinstance(u, Mapping)} if ulimits else set()
    for required in ("nofile", "nproc"):
        if required not in names:
            bad("Ulimits", f"must set {required}")
    log = hc.get("LogConfig")
    if not isinstance(log, Mapping) or log.get("Type") != "none":
        bad("LogConfig", 'must be {"Type": "none"} (a json log grows without bound on the host)')
    if problems:
        raise SecurityConfigError(
            "insecure container HostConfig: " + "; ".join(f"{k} {why}" for k, why in problems),
            key=f"HostConfig.{problems[0][0]}",
        )


# -- launcher protocol --------------------------------------------------------------------
def _sh_quote(text: str) -> str:
    """POSIX single quotes, with newlines spliced in from $N so a request stays one line."""
    return "'" + text.replace("'", "'\"'\"'").replace("\n", "'\"$N\"'") + "'"


def launcher_request(
    nonce: str, argv: Sequence[str], env: Mapping[str, str], prelude: str | None = None
) -> bytes:
    """The one line the launcher reads: ``<nonce> [prelude;] export ...; unset PWD; exec
    ARGV`` (``prelude``: the secrets' writer on a sandbox's first exec)."""
    parts: list[str] = [prelude] if prelude else []
    if env:
        parts.append("export " + " ".join(f"{k}={_sh_quote(v)}" for k, v in env.items()))
    parts.append("unset PWD")
    parts.append("exec " + " ".join(_sh_quote(a) for a in argv) + " </dev/null")
    return f"{nonce} {'; '.join(parts)}\n".encode("utf-8", "surrogateescape")


class _Trailer:
    """Finds the launcher's end marker in one stream, holding back only what could be its
    beginning, so output without NUL bytes is never delayed."""

    __slots__ = ("done", "pending", "prefix", "status")

    def __init__(self, nonce: str) -> None:
        self.prefix = _TRAILER_TAG + nonce.encode() + b":"
        self.pending = b""
        self.done = False
        self.status: int | None = None

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        buf = self.pending + data
        self.pending = b""
        at = buf.find(self.prefix)
        if at >= 0:
            end = at + len(self.prefix) + _TRAILER_STATUS_LEN
            if len(buf) >= end:
                digits = buf[at + len(self.prefix) : end - 1]
                self.status = int(digits) if digits.isdigit() else None
                self.done = True
            else:
                self.pending = buf[at:]
            return buf[:at]
        keep = 0
        if b"\0" in buf[-len(self.prefix) :]:
            for k in range(min(len(buf), len(self.prefix) - 1), 0, -1):
                if buf.endswith(self.prefix[:k]):
                    keep = k
                    break
        if keep:
            self.pending = buf[-keep:]
            return buf[:-keep]
        return buf

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


class _Demux:
    """Docker's multiplexed stream (no tty): 8-byte header [stream, 0, 0, 0, size BE] + payload."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        frames: list[tuple[int, bytes]] = []
        while len(self.buf) >= 8:
            size = int.from_bytes(self.buf[4:8], "big")
            if len(self.buf) < 8 + size:
                break
            frames.append((self.buf[0], bytes(self.buf[8 : 8 + size])))
            del self.buf[: 8 + size]
        return frames


class _AttachStream:
    """An exec's attach socket as the shared loop sees it: Docker's multiplexed frames,
    less the launcher's trailers (which carry the exit status), both directions."""

    def __init__(self, sock: socket.socket, nonce: str | None) -> None:
        self.sock = sock
        self.demux = _Demux()
        self.trailers = {1: _Trailer(nonce), 2: _Trailer(nonce)} if nonce else None
        self.eof = False

    @property
    def done(self) -> bool:
        """The command's output is complete: both trailers seen, or the socket closed."""
        return self.eof or (
            self.trailers is not None and all(t.done for t in self.trailers.values())
        )

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[tuple[int, bytes]] | None:
        data = self.sock.recv(exec_io.READ_CHUNK)
        if not data:
            self.eof = True
            return None
        frames: list[tuple[int, bytes]] = []
        for stream, frame in self.demux.feed(data):
            if stream not in (1, 2):
                continue
            frames.append((stream, self.trailers[stream].feed(frame) if self.trailers else frame))
        if self.done:
            return frames or None
        return frames

    def finish(self) -> list[tuple[int, bytes]]:
        if self.trailers is None:
            return []
        return [(s, t.flush()) for s, t in self.trailers.items() if not t.done]

    def write(self, data: memoryview) -> int:
        return self.sock.send(data)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)  # EOF on the command's stdin


class _RunningExec:
    """The exec as the shared loop sees it: exited when its leader's pidfd fires, the
    launcher's trailers arrive, or the engine says so; killed through its own cgroup."""

    def __init__(self, driver: DockerDriver, box: _Box, ex: _Exec, stream: _AttachStream) -> None:
        self.driver, self.box, self.ex, self.stream = driver, box, ex, stream
        self.exited = False

    def exit_fd(self) -> int | None:
        return self.ex.pidfd

    def poll(self) -> bool:
        if self.exited:
            return True
        if self.stream.trailers is not None and self.stream.done:
            self.exited = True
        elif self.ex.pidfd is not None:
            self.exited = bool(select.select([self.ex.pidfd], [], [], 0)[0])
        elif self.ex.exec_id is not None:
            self.exited = not self.driver._exec_running(self.ex.exec_id)
        elif self.stream.eof:
            self.exited = True
        return self.exited

    def kill(self) -> None:
        self.driver._kill_exec(self.box, self.ex)


# -- state ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Plan:
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
class _Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    plan: _Plan
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
class _Exec:
    sock: socket.socket
    pid: int
    exec_id: str | None  # None: through the launcher
    nonce: str | None
    cgroup: SandboxCgroup | None
    pidfd: int | None = None
    keep: Any = None  # the SDK object owning sock: keep it from the GC


def _raw_socket(obj: Any) -> socket.socket:
    """The socket under the SDK's hijacked response (SocketIO for unix, SSLSocket for TLS)."""
    sock = getattr(obj, "_sock", obj)
    if not isinstance(sock, socket.socket):
        raise DriverError(
            f"the docker driver needs a socket connection to the engine, got {type(obj).__name__}"
        )
    return sock


def _children(pid: int) -> list[int]:
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


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(pidfd: int | None, timeout_s: float = 0.0) -> bool:
    if pidfd is None:
        return False
    try:
        readable, _, _ = select.select([pidfd], [], [], timeout_s)
    except (OSError, ValueError):  # closed by a concurrent destroy: the sandbox is gone
        return True
    return bool(readable)


def _signal_of(code: int) -> int | None:
    # Engines report a signalled process as 128 + N, as shells do.
    return code - 128 if 128 < code <= 128 + MAX_SIGNAL else None


class DockerDriver:
    """Runs each sandbox in a hardened container; see the module docstring."""

    name = "docker"

    def __init__(
        self,
        *,
        emit: Emit | None = None,
        client: DockerClient | None = None,
        base_url: str | None = None,
        leases: LeaseRegistry | None = None,
        workspace_root: Path | None = None,
        engine_timeout_s: float = ENGINE_TIMEOUT_S,
        host_config_overrides: Mapping[str, Any] | None = None,
        watch_oom: bool = True,
        extra_labels: Mapping[str, str] | None = None,
    ) -> None:
        """``host_config_overrides`` are merged into every HostConfig (and validated like
        the rest); ``extra_labels`` mark containers (tests use them to find their own)."""
        docker_sdk()  # fail here, with the install hint, when the SDK is missing
        self._emit = emit
        self._client = client
        self._owns_client = client is None  # close() closes only a client we made
        self._base_url = base_url
        self.leases = leases or LeaseRegistry()
        self.workspace_root = workspace_root or Path(tempfile.gettempdir())
        self.engine_timeout_s = engine_timeout_s
        self.host_config_overrides = dict(host_config_overrides or {})
        self.watch_oom = watch_oom
        self.extra_labels = dict(extra_labels or {})
        self._boxes: dict[str, _Box] = {}
        self._by_container: dict[str, str] = {}  # container id -> sandbox id, kept after destroy
        self._lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._cg: CgroupSupport | None = None
        self._resolved: dict[tuple[str | None, tuple[str, ...], bool, bool], ResolvedImage] = {}
        self._owner = Owner.current()
        self.exhaustion = ResourceExhaustionHandler(
            self, emit=self._emit_event, temp_root=self.workspace_root
        )
        self.oom_watcher: SandboxManager | None = None
        self._pool = _WarmPool(self)
        self._remover = _Remover(self)
        self._closed = False

    # -- engine --------------------------------------------------------------------------
    @property
    def client(self) -> DockerClient:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = connect(self.engine_timeout_s, self._base_url)
        return self._client

    def _emit_event(self, event: str, payload: dict[str, Any]) -> None:
        if self._emit is not None:
            self._emit(event, payload)

    def engine_info(self) -> dict[str, Any]:
        if self._info is None:
            with engine_errors("docker info"):
                self._info = dict(self.client.info())
        return self._info

    @property
    def cgroups(self) -> CgroupSupport:
        if self._cg is None:
            self._cg = detect(require_writable=False)
        return self._cg

    def resolver(self, config: SandboxLifecycleConfig) -> ImageResolver:
        d = config.docker
        return ImageResolver(
            self.client,
            fallback_images=d.fallback_images,
            pull=d.pull,
            pull_timeout_s=d.pull_timeout_s,
            rebuild=d.rebuild_default_image,
            base_url=self._base_url,
        )

    def resolve_image(self, config: SandboxLifecycleConfig) -> ResolvedImage:
        """The image ``config`` runs, resolved once per process (re-resolved if it vanishes)."""
        name = config.image or config.docker.default_image
        d = config.docker
        key = (name, d.fallback_images, d.pull, d.rebuild_default_image)
        with self._lock:
            hit = self._resolved.get(key)
        if hit is not None:
            return hit
        resolved = self.resolver(config).resolve(name)
        with self._lock:
            self._resolved[key] = resolved
        return resolved

    def _forget_image(self) -> None:
        with self._lock:
            self._resolved.clear()

    def _ensure_watcher(self) -> None:
        if not self.watch_oom or self._closed:
            return
        with self._lock:
            if self.oom_watcher is not None:
                return
            owner = self._owner
            labels = (
                f"{LABEL_MANAGED}=true",
                f"{LABEL_OWNER_PID}={owner.pid}",
                f"{LABEL_OWNER_START}={owner.start_ticks or ''}",
            )
            self.oom_watcher = SandboxManager(
                self.exhaustion,
                source=DockerOomEvents(labels=labels, base_url=self._base_url),
            )
        self.oom_watcher.start()

    # -- isolation ---------------------------------------------------------------------------
    def _user(
        self, config: SandboxLifecycleConfig, image: ResolvedImage | None
    ) -> tuple[str, int | None, int | None]:
        """(the container's User, its numeric uid and gid when known)."""
        want = config.isolation.run_as_user
        if want == "current":
            return f"{os.geteuid()}:{os.getegid()}", os.geteuid(), os.getegid()
        if isinstance(want, int):
            return f"{want}:{want}", want, want
        configured = image.user if image is not None else ""
        if configured and configured.split(":")[0] not in {"0", "root"}:
            uid_text, _, gid_text = configured.partition(":")
            if uid_text.isdigit():
                uid = int(uid_text)
                gid = int(gid_text) if gid_text.isdigit() else uid
                return f"{uid}:{gid}", uid, gid
            return configured, None, None  # a name only the image's passwd resolves
        return f"{NOBODY_UID}:{NOBODY_GID}", NOBODY_UID, NOBODY_GID

    def _exec_cgroup_reason(self) -> str:
        if os.geteuid() != 0:
            return "needs root to make a cgroup per exec; an exec timeout kills the container"
        cg = self.cgroups
        if not cg.available:
            return f"no cgroup hierarchy here ({cg.reason}); an exec timeout kills the container"
        return ""

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" when a container for ``config`` will have it, else why not."""
        try:
            info = self.engine_info()
        except DevsSandboxError as exc:
            return dict.fromkeys(MECHANISMS, f"Docker engine not available: {exc}")
        report: dict[str, str] = dict.fromkeys(MECHANISMS, "")
        if not (info.get("MemoryLimit", True) and info.get("PidsLimit", True)):
            report["cgroup"] = "the engine cannot enforce memory and pids limits on this host"
        if config.network:
            report["net-namespace"] = "network requested (--network)"
        uid = self._user(config, None)[1]
        if uid == 0:
            report["unprivileged-user"] = "sandbox runs as root (isolation.runAsUser)"
        security = " ".join(str(o) for o in info.get("SecurityOptions") or ())
        if "seccomp" not in security:
            report["seccomp"] = "the engine has no seccomp support"
        report["exec-cgroup"] = self._exec_cgroup_reason()
        return report

    def _active(self, report: Mapping[str, str]) -> tuple[str, ...]:
        version = str(self.engine_info().get("CgroupVersion") or self.cgroups.version or "1")
        return tuple(
            f"cgroup-v{version}" if m == "cgroup" else m for m, why in report.items() if not why
        )

    # -- provision ---------------------------------------------------------------------------
    def _plan(self, config: SandboxLifecycleConfig) -> _Plan:
        image = self.resolve_image(config)
        user, uid, gid = self._user(config, image)
        pids_ok = bool(self.engine_info().get("PidsLimit", True))
        hc = build_host_config(config, uid=uid, gid=gid, pids_limit_supported=pids_ok)
        hc.update(self.host_config_overrides)
        validate_host_config(hc, network_allowed=config.network)
        host_env = os.environ
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": WORKSPACE,
            "LANG": host_env.get("LANG") or "C.UTF-8",
            "TERM": host_env.get("TERM") or "dumb",
            "TMPDIR": TMP,
            **config.env,
        }
        shape = hashlib.sha256(
            json.dumps(
                [image.image_id, user, hc, env, sorted(self.extra_labels.items())],
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:16]
        return _Plan(config, image, user, uid, gid, hc, env, shape)

    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """Create (or take from the warm pool) a hardened container. ``secrets`` are written
        through an exec's stdin into the container's private /tmp tmpfs, 0400, and named to
        each exec by ``NAME_FILE``: never in the container's environment or any argv, so
        ``docker inspect`` cannot show them."""
        if self._closed:
            raise DriverError("the docker driver was closed")
        validate_secrets(secrets)
        requested = validate_sandbox_id(config.sandbox_id) if config.sandbox_id else None
        report = self.isolation_report(config)
        missing: dict[str, str] = {}
        for m in config.isolation.required:
            why = report.get(m, "unknown mechanism")
            if why:
                missing[m] = why
        if missing:
            raise IsolationUnavailableError(missing)
        try:
            plan = self._plan(config)
        except DriverError as exc:
            if isinstance(exc, ProvisionError | DriverUnavailableError | ImageUnavailableError):
                raise
            raise ProvisionError(f"cannot provision a docker sandbox: {exc}") from exc
        self._ensure_watcher()
        active = self._active(report)
        pool_size = config.docker.warm_pool_size
        if pool_size and requested is None and config.copy_in is None:
            box = self._pool.take(plan, pool_size)
            if box is not None:
                box.plan = plan  # same container shape; this run's output cap and budgets
                with self._lock:
                    self._boxes[box.id] = box
                try:
                    self._place_secrets(box, secrets)
                except BaseException:
                    self.destroy(self._context(box))
                    raise
                return self._context(box)
        sandbox_id = requested or new_sandbox_id()
        box = _Box(sandbox_id, plan, self.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}", active)
        with self._lock:
            if sandbox_id in self._boxes:
                raise ProvisionError(f"sandbox {sandbox_id} already exists")
            self._boxes[sandbox_id] = box
        try:
            self._create(box)
            if config.copy_in is not None:
                self._copy_in(box, config.copy_in)
            self._place_secrets(box, secrets)
        except BaseException as exc:
            self._undo(box)
            if isinstance(exc, ProvisionError | SecurityConfigError | DriverUnavailableError):
                raise
            if isinstance(exc, ImageUnavailableError):
                raise
            if isinstance(exc, DevsSandboxError | OSError):
                raise ProvisionError(f"cannot provision sandbox {sandbox_id}: {exc}") from exc
            raise
        return self._context(box)

    def _place_secrets(self, box: _Box, secrets: Mapping[str, bytes | bytearray] | None) -> None:
        """Remember the secrets; they are written by the first exec (``_write_secrets``),
        so a warm container costs no extra exec to receive them."""
        if not secrets:
            return
        box.secrets = {name: bytearray(value) for name, value in secrets.items()}
        box.redactor = Redactor(box.secrets)
        box.secret_env = {f"{name}_FILE": f"{SECRETS_DIR}/{name}" for name in box.secrets}
        box.secrets_pending = True

    def _secrets_prelude(self, box: _Box) -> str | None:
        """Shell that writes the secrets, for the launcher's one request: the values travel
        in the request on the launcher's stdin (never argv, never the container's env),
        and printf is a builtin. None when a value cannot live in a shell string (NUL)."""
        if any(b"\0" in v for v in box.secrets.values()):
            return None
        writes = [
            f"(umask 0277 && printf %s {_sh_quote(bytes(v).decode('utf-8', 'surrogateescape'))}"
            f' > "$d/{name}")'
            for name, v in box.secrets.items()
        ]
        return (
            f'd={SECRETS_DIR}; mkdir -p "$d" && chmod 0700 "$d" && '
            + " && ".join(writes)
            + ' && chmod 0500 "$d" || exit 125'
        )

    def _write_secrets(self, box: _Box) -> None:
        """Without the launcher: one exec per secret, the value on the exec's stdin."""
        for name, value in box.secrets.items():
            result = self._run(
                box,
                ExecRequest(
                    ("/bin/sh", "-c", SECRET_WRITER, "devs-sandbox-secret", name),
                    stdin=bytes(value),
                ),
                launcher=False,
            )
            if result.exit_code != 0:
                raise DriverError(
                    f"cannot deliver secret {name} into the container (exit {result.exit_code}): "
                    f"{result.stderr.text.strip()[-200:]}"
                )

    def _context(self, box: _Box) -> SandboxContext:
        labels = {
            "container_id": box.container_id,
            "container_name": box.name,
            "image": box.plan.image.reference,
            "image_source": box.plan.image.source,
            "user": box.plan.user,
            "workspace_in_container": WORKSPACE,
        }
        return SandboxContext(
            id=box.id,
            driver=self.name,
            workspace=box.host_dir,
            isolation=box.isolation,
            labels=labels,
        )

    def _labels(self, box: _Box, pool: bool) -> dict[str, str]:
        owner = self._owner
        labels = {
            **self.extra_labels,
            LABEL_MANAGED: "true",
            LABEL_SANDBOX: box.id,
            LABEL_OWNER_PID: str(owner.pid),
            LABEL_OWNER_START: str(owner.start_ticks or ""),
            LABEL_OWNER_BOOT: owner.boot_id,
        }
        if pool:
            labels[LABEL_POOL] = box.plan.shape
        return labels

    def _create(self, box: _Box, *, pool: bool = False) -> None:
        """Lease, host dir, create, start, attach; each step recorded on ``box`` for _undo."""
        plan = box.plan
        if self.leases.is_live(box.id):
            raise ProvisionError(f"sandbox id {box.id} is in use by a live process")
        # The lease comes first, so a crash at any later step leaves a findable orphan.
        self.leases.write(Lease(box.id, self.name, self._owner, str(box.host_dir)))
        box.leased = True
        try:
            box.host_dir.mkdir(mode=0o700)
        except FileExistsError:
            raise ProvisionError(
                f"{box.host_dir} already exists (sandbox id in use? run `devs-sandbox cleanup`)"
            ) from None
        box.made_dir = True
        # Checked again here, on the final dict, right before the engine sees it.
        validate_host_config(plan.host_config, network_allowed=plan.config.network)
        api = self.client.api
        env = [f"{k}={v}" for k, v in {**plan.env, "DEVS_SANDBOX_ID": box.id}.items()]
        untyped: Any = api  # the stubs want a HostConfig object; the API takes the dict
        with engine_errors(f"create container {box.name}"):
            create = untyped.create_container_config(
                plan.image.image_id,
                ["/bin/sh", "-c", LAUNCHER, LAUNCHER_NAME],
                hostname="sandbox",
                user=plan.user,
                stdin_open=True,
                environment=env,
                working_dir=WORKSPACE,
                labels=self._labels(box, pool),
                stop_signal="SIGKILL",
                host_config=plan.host_config,
            )
            create["StdinOnce"] = False  # the SDK sets it with stdin_open; detaching must not
            # close the launcher's stdin (that would stop the container)
            try:
                created = untyped.create_container_from_config(create, name=box.name)
            except Exception as exc:
                if is_not_found(exc):
                    self._forget_image()  # the resolved image vanished: resolve it again
                else:  # a timeout may hide a container that was made after all
                    self._remove_if_ours(box.name)
                raise
        box.container_id = str(created["Id"])
        with self._lock:
            self._by_container[box.container_id] = box.id
        with engine_errors(f"start container {box.name}"):
            api.start(box.container_id)
            state = api.inspect_container(box.container_id)["State"]
        init_pid = int(state.get("Pid") or 0)
        if not state.get("Running") or init_pid <= 0:
            raise ProvisionError(
                f"container {box.name} did not start: {state.get('Error') or state}"
            )
        box.init_pid = init_pid
        box.init_pidfd = _pidfd(init_pid)
        if box.init_pidfd is not None and not self._is_container_pid(init_pid, box.container_id):
            raise ProvisionError(f"container {box.name} exited right after it started")
        # docker-init's only child is the launcher; without it every exec is a docker exec.
        box.launcher_pid = self._wait_child(init_pid, EXEC_START_TIMEOUT_S)
        support = self.cgroups
        if support.available:
            dirs = cgroup_dirs_of(init_pid, support)
            wanted = {
                k: v for k, v in dirs.items() if k in {"memory", "pids", "cpuacct", "unified"}
            }
            if wanted:
                box.cgroup = SandboxCgroup(support, box.id, dirs=wanted)
            if not self._exec_cgroup_reason():
                for ctrl in ("unified", "freezer", "pids"):
                    if ctrl in dirs and os.access(dirs[ctrl], os.W_OK):
                        box.exec_parent = {ctrl: dirs[ctrl]}
                        break
        if box.launcher_pid is not None:
            with engine_errors(f"attach to {box.name}"):
                params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                box.launcher_keep = api.attach_socket(box.container_id, params=params)
                box.launcher_sock = _raw_socket(box.launcher_keep)
        root = Path(f"/proc/{init_pid}/root{WORKSPACE}")
        box.scanner = WorkspaceScanner(
            root, budget_s=plan.config.quotas.depth_scan_budget_ms / 1000
        )
        (box.host_dir / "container-id").write_text(box.container_id + "\n")

    @staticmethod
    def _is_container_pid(pid: int, container_id: str) -> bool:
        try:
            return container_id in Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False

    @staticmethod
    def _wait_child(pid: int, timeout_s: float) -> int | None:
        end = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            kids = _children(pid)
            if kids:
                return kids[0]
            if time.monotonic() >= end:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _copy_in(self, box: _Box, source: Path) -> None:
        """Seed the workspace through tar in the container, as the sandbox user, so the
        tmpfs limits apply and ownership is right (the engine cannot copy into a tmpfs)."""
        if not source.is_dir():
            raise ProvisionError(f"--copy-in {source}: not a directory")
        with tempfile.SpooledTemporaryFile(
            max_size=COPY_SPOOL_BYTES, dir=str(box.host_dir)
        ) as spool:
            with tarfile.open(fileobj=spool, mode="w") as tar:
                for entry in sorted(source.iterdir()):
                    tar.add(entry, arcname=entry.name, recursive=True)
            spool.seek(0)
            result = self._run(
                box,
                ExecRequest(("tar", "-x", "-o", "-f", "-", "-C", WORKSPACE)),
                stdin_file=spool,
                launcher=False,
            )
        if result.exit_code != 0:
            raise ProvisionError(
                f"--copy-in {source}: tar in the container exited {result.exit_code} "
                "(more files than quotas.fileCountLimit or bytes than quotas.diskBytes? "
                f"no tar in the image?): {result.stderr.text.strip()[-300:]}"
            )

    # -- exec ---------------------------------------------------------------------------------
    def _box(self, ctx: SandboxContext) -> _Box:
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            raise SandboxNotFoundError(ctx.id)
        return box

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        box = self._box(ctx)
        return self._run(box, request.replace(env={**box.secret_env, **request.env}))

    def _run(
        self,
        box: _Box,
        request: ExecRequest,
        *,
        stdin_file: IO[bytes] | None = None,
        launcher: bool = True,
    ) -> ExecResult:
        command, stdin = request.argv, request.stdin
        max_output_bytes = request.max_output_bytes
        if request.cwd is not None:
            # A directory of the workspace: the shell changes into it, then becomes the command.
            command = ("/bin/sh", "-c", CD_SHIM, f"{WORKSPACE}/{request.cwd}", *command)
        cap = box.config.max_output_bytes if max_output_bytes is None else max_output_bytes
        extra = dict(request.env)
        sock: socket.socket | None = None
        through_launcher = (
            launcher
            and stdin is None
            and stdin_file is None
            and box.launcher_pid is not None
            and all(ENV_NAME.fullmatch(k) for k in extra)
        )
        prelude: str | None = None
        if box.secrets_pending and launcher:  # a user's exec: the secrets must be there first
            box.secrets_pending = False
            prelude = self._secrets_prelude(box) if through_launcher else None
            if prelude is None:
                self._write_secrets(box)
        if through_launcher:
            with box.lock:
                sock, box.launcher_sock = box.launcher_sock, None
        if box.cgroup is not None and "memory" in box.cgroup.dirs:
            # Per-exec peak: v1 lets us reset the high-water mark.
            with contextlib.suppress(OSError):
                (box.cgroup.dirs["memory"] / "memory.max_usage_in_bytes").write_text("0")
        cpu_before = self._counters(box).cpu_time_s
        start = time.monotonic()
        if sock is not None:
            ex = self._start_launcher(box, sock, command, extra, prelude)
        else:
            ex = self._start_exec(box, command, extra, stdin is not None or stdin_file is not None)
        try:
            if request.on_start is not None:
                try:
                    request.on_start(ex.pid)
                except Exception:
                    logger.exception("on_start callback failed")
            return self._pump(
                box, ex, request, start=start, stdin_file=stdin_file, cap=cap, cpu_before=cpu_before
            )
        finally:
            with contextlib.suppress(OSError):
                ex.sock.close()
            if ex.pidfd is not None:
                os.close(ex.pidfd)
            if ex.cgroup is not None and not ex.cgroup.pids() and not ex.cgroup.remove():
                with box.lock:
                    box.exec_cgroups.remove(ex.cgroup)

    def _confine(self, box: _Box, pid: int) -> SandboxCgroup | None:
        """Move the (waiting) exec leader into a cgroup of its own inside the container's."""
        if box.exec_parent is None:
            return None
        seq = next(box.exec_seq)
        dirs = {k: v / f"devs-exec-{seq}" for k, v in box.exec_parent.items()}
        cg = SandboxCgroup(self.cgroups, box.id, dirs=dirs)
        try:
            cg.make_dirs()
            cg.add(pid)
        except OSError as exc:
            logger.warning("sandbox %s: no cgroup for exec %d (%s)", box.id, seq, exc)
            cg.remove()
            return None
        with box.lock:
            box.exec_cgroups.append(cg)
        return cg

    def _start_launcher(
        self,
        box: _Box,
        sock: socket.socket,
        command: Sequence[str],
        env: Mapping[str, str],
        prelude: str | None = None,
    ) -> _Exec:
        nonce = secrets.token_hex(8)
        try:
            sock.sendall(launcher_request(nonce, command, env, prelude))
        except OSError as exc:
            with contextlib.suppress(OSError):
                sock.close()
            raise self._lost(box, f"cannot reach the launcher: {exc}") from exc
        assert box.launcher_pid is not None
        pid = self._wait_child(box.launcher_pid, EXEC_START_TIMEOUT_S)
        if pid is None:
            with contextlib.suppress(OSError):
                sock.close()
            raise self._lost(box, "the launcher did not start the command")
        ex = _Exec(sock, pid, None, nonce, self._confine(box, pid), _pidfd(pid))
        try:
            sock.sendall(b"go\n")
        except OSError as exc:
            with contextlib.suppress(OSError):
                sock.close()
            raise self._lost(box, f"cannot reach the launcher: {exc}") from exc
        return ex

    def _start_exec(
        self, box: _Box, command: Sequence[str], env: Mapping[str, str], with_stdin: bool
    ) -> _Exec:
        # The process driver's shim, with no cgroup to join itself (the exec is confined
        # from outside, into a child of the container's cgroup).
        argv = ["/bin/sh", "-c", SHIM, SHIM_NAME, "1" if with_stdin else "0", "0", *command]

        def missing() -> DevsSandboxError:
            return SandboxNotFoundError(box.id)

        try:
            with engine_errors(f"exec in {box.name}", not_found=missing):
                exec_id, keep = self._create_exec(box, argv, env)
        except DriverError as exc:
            if isinstance(exc, DriverUnavailableError):
                raise
            raise self._lost(box, str(exc)) from exc
        sock = _raw_socket(keep)
        try:
            pid = self._exec_pid(exec_id)
            ex = _Exec(sock, pid, exec_id, None, self._confine(box, pid), _pidfd(pid), keep)
            sock.sendall(b"go\n")
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return ex

    def _create_exec(
        self, box: _Box, argv: Sequence[str], env: Mapping[str, str]
    ) -> tuple[str, Any]:
        api = self.client.api
        exec_id = str(
            api.exec_create(
                box.container_id,
                argv,
                stdin=True,
                stdout=True,
                stderr=True,
                environment=[f"{k}={v}" for k, v in env.items()] or None,
                workdir=WORKSPACE,
            )["Id"]
        )
        # The shim waits for "go": nothing can reach the stream before we read the raw socket
        # (bytes sent with the HTTP upgrade response would sit in the SDK's buffer).
        return exec_id, api.exec_start(exec_id, socket=True)

    def _exec_pid(self, exec_id: str) -> int:
        api = self.client.api
        end = time.monotonic() + EXEC_START_TIMEOUT_S
        delay = 0.0005
        while True:
            with engine_errors("inspect exec"):
                info = api.exec_inspect(exec_id)
            pid = int(info.get("Pid") or 0)
            if pid > 0:
                return pid
            if info.get("ExitCode") is not None and not info.get("Running"):
                raise DriverError(f"exec ended before it started (exit {info.get('ExitCode')})")
            if time.monotonic() >= end:
                raise DriverError(
                    f"the engine did not start the exec within {EXEC_START_TIMEOUT_S} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _lost(self, box: _Box, why: str) -> DevsSandboxError:
        if not self._alive(box):
            return SandboxNotFoundError(box.id)
        return DriverError(f"sandbox {box.id}: {why}")

    def _kill_exec(self, box: _Box, ex: _Exec) -> None:
        if ex.cgroup is not None and ex.cgroup.kill_all():
            return
        # No cgroup of its own: only the whole container is certain to reach every process.
        logger.warning("sandbox %s: killing the whole container to stop an exec", box.id)
        self._stop_box(box)

    def _pump(
        self,
        box: _Box,
        ex: _Exec,
        request: ExecRequest,
        *,
        start: float,
        stdin_file: IO[bytes] | None,
        cap: int,
        cpu_before: float | None,
    ) -> ExecResult:
        ex.sock.setblocking(False)
        stream = _AttachStream(ex.sock, ex.nonce)
        feeding = request.stdin is not None or stdin_file is not None
        io = exec_io.ExecIO(
            sources=[stream],
            process=_RunningExec(self, box, ex, stream),
            stdin=stream if feeding else None,
            stdin_data=request.stdin if request.stdin is not None else (b"" if feeding else None),
            stdin_file=stdin_file,
            sample=lambda: self._sample_processes(box),
            # After the task exits the launcher writes its trailers at once; a plain exec's
            # stream may be held by a grandchild, as a pipe would be.
            exit_grace_s=LAUNCHER_TRAILER_WAIT_S if ex.nonce else exec_io.EXIT_DRAIN_GRACE_S,
            exit_poll_s=ENGINE_POLL_S,
        )
        outcome = exec_io.run(
            io,
            timeout_s=request.timeout_s,
            idle_timeout_s=request.idle_timeout_s,
            max_output_bytes=cap,
            redactor=box.redactor,
            on_stdout=request.on_stdout,
            on_stderr=request.on_stderr,
            start=start,
        )
        code = self._exit_status(box, ex, stream.trailers)
        if code is None:  # the container or the launcher died under the command
            code = 128 + signal.SIGKILL
        self._sample_processes(box)
        return ExecResult(
            exit_code=code,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            duration_s=outcome.duration_s,
            timed_out=outcome.timed_out,
            idle_timed_out=outcome.idle_timed_out,
            signal=_signal_of(code),
            resources=self._usage(box, outcome.duration_s, cpu_before),
        )

    def _exec_running(self, exec_id: str | None) -> bool:
        if exec_id is None:
            return False
        try:
            with engine_errors("inspect exec"):
                return bool(self.client.api.exec_inspect(exec_id).get("Running"))
        except DevsSandboxError:
            return False

    def _exit_status(
        self, box: _Box, ex: _Exec, trailers: Mapping[int, _Trailer] | None
    ) -> int | None:
        if trailers is not None:
            for t in trailers.values():
                if t.status is not None:
                    return t.status
            return None
        assert ex.exec_id is not None
        end = time.monotonic() + EXIT_STATUS_WAIT_S
        while True:
            try:
                with engine_errors("inspect exec"):
                    info = self.client.api.exec_inspect(ex.exec_id)
            except DevsSandboxError:
                return None  # the container is gone (removed after an OOM kill, say)
            code = info.get("ExitCode")
            if not info.get("Running") and code is not None:
                return int(code)
            if time.monotonic() >= end or not self._alive(box):
                return None
            time.sleep(0.01)

    def _sample_processes(self, box: _Box) -> None:
        if box.cgroup is None:
            return
        n = box.cgroup.pids_current()
        if n is not None:
            box.peak_processes = max(box.peak_processes, n - INFRA_PROCESSES)

    def _usage(self, box: _Box, wall_s: float, cpu_before: float | None) -> ResourceUsage:
        cpu: float | None = None
        peak_mem: int | None = None
        if box.cgroup is not None:
            c = self._counters(box)
            if c.cpu_time_s is not None and cpu_before is not None:
                cpu = max(0.0, c.cpu_time_s - cpu_before)
            peak_mem = c.peak_memory_bytes
            # Not pids.peak: it also counts the engine's own start-up processes (runc init).
        return ResourceUsage(
            cpu_time_s=cpu,
            peak_memory_bytes=peak_mem,
            peak_processes=max(box.peak_processes, 1),
            wall_time_s=wall_s,
        )

    # -- observe / stop --------------------------------------------------------------------------
    def _counters(self, box: _Box) -> CgroupCounters:
        """The container's cgroup counters; the last ones read once it is gone (cumulative
        counters stay true after the container stops)."""
        if box.cgroup is not None and self._alive(box):
            c = box.cgroup.counters()
            if c.memory_bytes is not None or c.pids_current is not None:
                box.last = c
                return c
        return box.last

    def _alive(self, box: _Box) -> bool:
        if box.init_pidfd is not None:
            return not _exited(box.init_pidfd)
        if not box.container_id:
            return False
        try:
            with engine_errors("inspect container"):
                state = self.client.api.inspect_container(box.container_id)["State"]
        except DevsSandboxError:
            return False
        return bool(state.get("Running"))

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        box = self._box(ctx)
        alive = self._alive(box)
        c = self._counters(box)
        procs = None if c.pids_current is None else max(0, c.pids_current - INFRA_PROCESSES)
        if procs is not None and alive:
            box.peak_processes = max(box.peak_processes, procs)
        # The engine's event may beat the cgroup read, or arrive after the container is gone.
        oom = (
            None
            if c.oom_kills is None and not box.oom_events
            else max(c.oom_kills or 0, box.oom_events)
        )
        file_count = depth = largest = disk = inodes_free = disk_free = None
        if alive and box.init_pid is not None:
            root = Path(f"/proc/{box.init_pid}/root")
            frees: list[tuple[int, int]] = []
            for mount in (WORKSPACE, TMP):
                with contextlib.suppress(OSError):
                    st = os.statvfs(f"{root}{mount}")
                    frees.append((st.f_ffree, st.f_bavail * st.f_frsize))
                    if mount == WORKSPACE:
                        file_count = max(0, st.f_files - st.f_ffree - 1)  # minus the root inode
                        disk = (st.f_blocks - st.f_bfree) * st.f_frsize
            if frees:
                inodes_free = min(f[0] for f in frees)
                disk_free = min(f[1] for f in frees)
            scan = box.scanner.scan() if box.scanner is not None else None
            # The pidfd proves init was ours before and after the walk: a recycled pid's
            # /proc/<pid>/root would have been someone else's tree.
            if scan is not None and self._alive(box):
                depth, largest = scan.max_depth, scan.largest_file_bytes
        return SandboxMetrics(
            sandbox_id=box.id,
            timestamp=time.monotonic(),
            process_count=procs if alive else 0,
            memory_bytes=c.memory_bytes if alive else None,
            peak_memory_bytes=c.peak_memory_bytes,
            cpu_time_s=c.cpu_time_s,
            file_count=file_count,
            directory_depth=depth,
            largest_file_bytes=largest,
            disk_bytes=disk,
            inodes_free=inodes_free,
            disk_free_bytes=disk_free,
            pids_limit_hits=c.pids_limit_hits,
            oom_kills=oom,
            running=alive,
        )

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            box = self._boxes.get(ctx.id)
        return box is not None and self._alive(box)

    def _stop_box(self, box: _Box) -> None:
        """SIGKILL init: the kernel kills everything else in its pid namespace with it."""
        if box.init_pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(box.init_pidfd, signal.SIGKILL)
            if _exited(box.init_pidfd, STOP_WAIT_S):
                return
        if box.container_id:
            with contextlib.suppress(DevsSandboxError), engine_errors("kill container"):
                self.client.api.kill(box.container_id, signal="SIGKILL")

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every process; the stopped container stays (inspectable) until destroy."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is not None:
            self._stop_box(box)

    # -- destroy --------------------------------------------------------------------------------
    # REQ: 8_RISKS-REQ-123
    def member_pids(self, ctx: SandboxContext) -> list[int]:
        """Host pids of every process in the container (its cgroup): what a double fork
        re-parented to the container's init still belongs to."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None or box.cgroup is None:
            return []
        return box.cgroup.all_pids()

    def destroy(self, ctx: SandboxContext) -> None:
        with self._lock:
            box = self._boxes.pop(ctx.id, None)
        if box is None:
            self._remove_by_id(ctx.id, ctx.workspace, ctx.labels.get("container_id") or None)
            return
        wipe(box.secrets.values())
        box.secrets.clear()
        with box.lock:
            sock, box.launcher_sock, box.launcher_keep = box.launcher_sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        if box.config.docker.warm_pool_size and box.init_pidfd is not None:
            # Warm-pool mode trades a synchronous remove (~50 ms) for a kill that is total at
            # once (pid namespace) and a removal in the background; the lease stays until the
            # container is gone, and close() waits for it.
            self._stop_box(box)
            self._remover.submit(box)
            return
        self._finish(box)

    def _undo(self, box: _Box) -> None:
        """Tear down what a failed provision made, and only that: when the id collided with
        another process's sandbox, its container, directory and lease are not ours."""
        with self._lock:
            if self._boxes.get(box.id) is box:
                del self._boxes[box.id]
        with box.lock:
            sock, box.launcher_sock, box.launcher_keep = box.launcher_sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        left: list[str] = []
        if box.container_id:
            try:
                self.remove_container(box.container_id)
            except DevsSandboxError as exc:
                left.append(f"container {box.name}: {exc}")
        if box.init_pidfd is not None:
            os.close(box.init_pidfd)
            box.init_pidfd = None
        for cg in box.exec_cgroups:
            left += cg.remove()
        if box.made_dir:
            shutil.rmtree(box.host_dir, ignore_errors=True)
            if box.host_dir.exists():
                left.append(f"{box.host_dir}: still present")
        if box.leased:
            self._settle_lease(box.id, box.host_dir, left)

    def _remove_if_ours(self, name: str) -> None:
        """Remove the container called ``name`` if its labels say this process made it."""
        try:
            with engine_errors("inspect container"):
                labels = self.client.api.inspect_container(name)["Config"]["Labels"] or {}
            if _owner_from_labels(labels) == self._owner:
                self.remove_container(name)
        except DevsSandboxError:
            pass

    def _finish(self, box: _Box) -> None:
        if box.init_pidfd is not None and self._alive(box):
            self._stop_box(box)  # a stopped container is removed faster than a running one
        left = self._remove_by_id(box.id, box.host_dir, box.container_id or None, lease=False)
        if box.init_pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(box.init_pidfd)
            box.init_pidfd = None
        for cg in box.exec_cgroups:
            left += cg.remove()
        self._settle_lease(box.id, box.host_dir, left)

    def _remove_by_id(
        self,
        sandbox_id: str,
        host_dir: Path,
        container: str | None,
        *,
        lease: bool = True,
    ) -> list[str]:
        """Remove the container (by id, else by name) and the host dir; what could not go."""
        left: list[str] = []
        ref = container or f"{CONTAINER_PREFIX}{sandbox_id}"
        try:
            self.remove_container(ref)
        except DevsSandboxError as exc:
            left.append(f"container {ref}: {exc}")
        if host_dir.exists() or host_dir.is_symlink():
            if host_dir.is_symlink():
                host_dir.unlink()
            else:
                shutil.rmtree(host_dir, ignore_errors=True)
            if host_dir.exists():
                left.append(f"{host_dir}: still present")
        if lease:
            self._settle_lease(sandbox_id, host_dir, left)
        return left

    def _settle_lease(self, sandbox_id: str, host_dir: Path, left: list[str]) -> None:
        if left:
            logger.warning("sandbox %s: could not remove %s", sandbox_id, "; ".join(left))
            # Keep the lease but hand it to nobody, so the next reaper retries.
            self.leases.write(Lease(sandbox_id, self.name, Owner(0, None, ""), str(host_dir)))
        else:
            self.leases.remove(sandbox_id)

    # REQ: 8_RISKS-REQ-123
    def reap_orphans(self) -> list[str]:
        """Remove containers labelled ``devs.managed=true`` whose owner process is gone, and
        docker leases whose owner is gone; never another driver's, never a live owner's."""
        try:
            with engine_errors("list containers"):
                found = self.client.api.containers(
                    all=True, filters={"label": f"{LABEL_MANAGED}=true"}
                )
        except DevsSandboxError as exc:
            logger.debug("no docker orphans reaped: %s", exc)
            return []
        with self._lock:
            mine = set(self._boxes) | self._pool.ids()
        reaped: list[str] = []
        for c in found:
            labels = c.get("Labels") or {}
            sandbox_id = str(labels.get(LABEL_SANDBOX) or "")
            if sandbox_id in mine:
                continue
            if _owner_from_labels(labels).alive():
                continue
            try:
                sandbox_id = validate_sandbox_id(sandbox_id)
            except DevsSandboxError:  # not one of ours to name a path after: container only
                with contextlib.suppress(DevsSandboxError):
                    self.remove_container(str(c["Id"]))
                    reaped.append(str(c["Id"])[:12])
                continue
            host_dir = self.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}"
            if not self._remove_by_id(sandbox_id, host_dir, str(c["Id"])):
                reaped.append(sandbox_id)
        for sandbox_id, lease in self.leases.orphans(driver=self.name):
            if lease is None or sandbox_id in mine or sandbox_id in reaped:
                continue
            if not self._remove_by_id(sandbox_id, Path(lease.workspace), None):
                reaped.append(sandbox_id)
        return reaped

    # -- the exhaustion handler's view of the engine (exhaustion.ContainerOps) ---------------
    def _box_for_container(self, container_id: str) -> _Box | None:
        with self._lock:
            sandbox_id = self._by_container.get(container_id)
            if sandbox_id is None:
                for cid, sid in self._by_container.items():
                    if cid.startswith(container_id) or container_id.startswith(cid):
                        sandbox_id = sid
                        break
            return self._boxes.get(sandbox_id) if sandbox_id else None

    def note_oom(self, container_id: str) -> None:
        box = self._box_for_container(container_id)
        if box is not None:
            with box.lock:
                box.oom_events += 1
            self._counters(box)  # keep the peak and the counters from before the teardown

    def sandbox_id_of(self, container_id: str) -> str | None:
        with self._lock:
            known = self._by_container.get(container_id)
        if known is not None:
            return known
        try:
            with engine_errors("inspect container"):
                labels = self.client.api.inspect_container(container_id)["Config"]["Labels"] or {}
        except DevsSandboxError:
            return None
        value = labels.get(LABEL_SANDBOX)
        return str(value) if value else None

    def is_container_running(self, container_id: str) -> bool:
        box = self._box_for_container(container_id)
        if box is not None:
            return self._alive(box)
        try:
            with engine_errors("inspect container"):
                return bool(self.client.api.inspect_container(container_id)["State"]["Running"])
        except DevsSandboxError:
            return False

    def stop_container(self, container_id: str) -> None:
        box = self._box_for_container(container_id)
        if box is not None:
            self._stop_box(box)
            return
        docker = docker_sdk()
        with engine_errors(f"kill container {container_id[:24]}"):
            try:
                self.client.api.kill(container_id, signal="SIGKILL")
            except docker.errors.APIError as exc:
                if exc.status_code not in (404, 409):  # gone, or not running: stopped either way
                    raise

    def remove_container(self, container_id: str) -> None:
        """``docker rm -f``: a container that is already gone (or going) is fine."""
        docker = docker_sdk()
        with engine_errors(f"remove container {container_id[:24]}"):
            try:
                self.client.api.remove_container(container_id, force=True)
            except docker.errors.APIError as exc:
                if exc.status_code == 404:
                    return
                if exc.status_code == 409 and "already in progress" in str(exc):
                    return  # another remover (the OOM handler, a reaper) got there first
                raise

    # -- optional capabilities ------------------------------------------------------------------
    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        """The lifecycle routes a full workspace here: the handler reports and cleans up."""
        if not isinstance(error, DiskQuotaExceededError):
            return
        with self._lock:
            box = self._boxes.get(ctx.id)
        container = box.container_id if box is not None else ctx.labels.get("container_id")
        if container:
            self.exhaustion.on_disk_quota_exceeded(container)

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        """Runtimes the image declares (``devs.runtimes``); None when it declares nothing."""
        try:
            image = self.resolve_image(config)
        except DevsSandboxError:
            return None
        return None if image.runtimes is None else frozenset(image.runtimes)

    def close(self) -> None:
        """Stop the OOM watcher, drop the warm pool, finish background removals."""
        self._closed = True
        watcher = self.oom_watcher
        if watcher is not None:
            watcher.shutdown()
        self._pool.close()
        self._remover.close()
        if self._owns_client:
            with self._lock:
                client, self._client = self._client, None  # a later destroy reconnects
            if client is not None:
                client.close()


def _owner_from_labels(labels: Mapping[str, Any]) -> Owner:
    try:
        pid = int(labels.get(LABEL_OWNER_PID) or 0)
    except ValueError:
        pid = 0
    start_raw = str(labels.get(LABEL_OWNER_START) or "")
    start = int(start_raw) if start_raw.isdigit() else None
    return Owner(pid, start, str(labels.get(LABEL_OWNER_BOOT) or ""))


class _WarmPool:
    """Containers created, started and attached ahead of time, per configuration shape."""

    def __init__(self, driver: DockerDriver) -> None:
        self.driver = driver
        self._ready: dict[str, deque[_Box]] = {}
        self._wanted: OrderedDict[str, tuple[_Plan, int]] = OrderedDict()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._filling = 0

    def ids(self) -> set[str]:
        with self._cond:
            return {b.id for q in self._ready.values() for b in q}

    def take(self, plan: _Plan, size: int) -> _Box | None:
        dropped: list[_Box] = []
        with self._cond:
            self._wanted[plan.shape] = (plan, size)
            self._wanted.move_to_end(plan.shape)
            while len(self._wanted) > POOL_MAX_SHAPES:  # a config nobody asked for lately
                old, _ = self._wanted.popitem(last=False)
                dropped += self._ready.pop(old, ())
            ready = self._ready.get(plan.shape)
            box = ready.popleft() if ready else None
            self._cond.notify_all()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._fill, name="devs-docker-pool", daemon=True
                )
                self._thread.start()
        for stale in dropped:
            self.driver._finish(stale)
        if box is not None and not self.driver._alive(box):
            self.driver._finish(box)
            return None
        return box

    def _next_job(self) -> _Plan | None:
        """Block until some shape wants another container; None when stopping."""
        with self._cond:
            while not self._stopping:
                for shape, (plan, size) in self._wanted.items():
                    if len(self._ready.get(shape, ())) < size:
                        self._filling += 1
                        return plan
                self._cond.wait()
            return None

    def _fill(self) -> None:
        while True:
            plan = self._next_job()
            if plan is None:
                return
            sandbox_id = new_sandbox_id()
            box = _Box(
                sandbox_id, plan, self.driver.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}", ()
            )
            try:
                box.isolation = self.driver._active(self.driver.isolation_report(plan.config))
                self.driver._create(box, pool=True)
            except Exception as exc:
                logger.warning("warm pool: creating a container failed: %s", exc)
                self.driver._undo(box)
                with self._cond:
                    self._filling -= 1
                    self._cond.wait(POOL_FILL_BACKOFF_S)  # close() notifies: no long wait
                continue
            with self._cond:
                self._filling -= 1
                keep = not self._stopping
                if keep:
                    self._ready.setdefault(plan.shape, deque()).append(box)
                self._cond.notify_all()
            if not keep:
                self.driver._finish(box)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(REMOVE_FLUSH_S)
        with self._cond:
            boxes = [b for q in self._ready.values() for b in q]
            self._ready.clear()
        for box in boxes:
            with contextlib.suppress(OSError):
                if box.launcher_sock is not None:
                    box.launcher_sock.close()
            self.driver._finish(box)


class _Remover:
    """Removes killed containers in the background (warm-pool mode); ``close`` drains it."""

    def __init__(self, driver: DockerDriver) -> None:
        self.driver = driver
        self._queue: queue.Queue[_Box | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, box: _Box) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="devs-docker-remover", daemon=True
                )
                self._thread.start()
        self._queue.put(box)

    def _work(self) -> None:
        while True:
            box = self._queue.get()
            try:
                if box is None:
                    return
                self.driver._finish(box)
            except Exception:
                logger.exception("background removal failed")
            finally:
                self._queue.task_done()

    def close(self) -> None:
        with self._lock:
            thread = self._thread
            self._thread = None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(REMOVE_FLUSH_S)
        if thread.is_alive():
            logger.error("background container removals did not finish in %.0f s", REMOVE_FLUSH_S)

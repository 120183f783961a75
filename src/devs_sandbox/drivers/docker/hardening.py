"""The container's HostConfig: built hardened in one place (``build_host_config``) and
checked right before every create (``validate_host_config``), whoever built or amended it
(``host_config_overrides``): a setting that weakens the sandbox raises
``SecurityConfigError`` naming it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.docker.state import TMP, WORKSPACE
from devs_sandbox.drivers.linux import HOST_MECHANISMS
from devs_sandbox.errors import SecurityConfigError
from devs_sandbox.isolation import NOBODY_GID, NOBODY_UID

INFRA_PROCESSES: Final = 2  # docker-init and the launcher: not the task's, not counted
NPROC_BACKSTOP_FACTOR: Final = 4  # RLIMIT_NPROC is per uid host-wide: equal to the pids
# limit, one sandbox's fork bomb would starve every other sandbox running as nobody
CPU_PERIOD_US: Final = 100_000

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

# The host's mechanisms (same names, same meaning as the process driver's), then the
# engine's own.
MECHANISMS: Final = (
    *HOST_MECHANISMS,
    "cap-drop-all",
    "no-new-privileges",
    "read-only-rootfs",
    "seccomp",
    "exec-cgroup",
)


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

"""Who a sandbox runs as and which host mechanism gives it each layer, decided before
anything is made: the report a run's ``isolation`` and ``warnings`` come from, and the
refusal when a promised layer has no mechanism here."""

from __future__ import annotations

import hashlib
import os
import pwd
from collections.abc import Mapping, Sequence
from typing import Final

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.process.state import MECHANISMS, NAMESPACES, Plan
from devs_sandbox.errors import IsolationUnavailableError, ProvisionError
from devs_sandbox.isolation import (
    NOBODY_GID,
    NOBODY_UID,
    SANDBOX_UID_BASE,
    SANDBOX_UID_SPAN,
    HostSupport,
    is_sandbox_uid,
)
from devs_sandbox.leases import LeaseRegistry

TUN_DEVICE: Final = "/dev/net/tun"


def run_as(
    config: SandboxLifecycleConfig, leases: LeaseRegistry, sandbox_id: str | None = None
) -> tuple[int, int]:
    """The sandbox's (uid, gid). As root with "auto", a uid of its own per sandbox: with
    one shared uid, a sandbox without a mount namespace could read another's workspace and
    secrets, and signal its processes. ``sandbox_id`` None: any such uid (for reports)."""
    euid = os.geteuid()
    want = config.isolation.run_as_user
    if want == "current":
        return euid, os.getegid()
    if want == "nobody":
        return NOBODY_UID, NOBODY_GID
    if want == "auto":
        if euid != 0:
            return euid, os.getegid()
        uid = SANDBOX_UID_BASE if sandbox_id is None else sandbox_uid(sandbox_id, leases)
        return uid, uid
    uid = int(want)
    if euid not in (uid, 0):
        raise IsolationUnavailableError({"unprivileged-user": f"switching to uid {uid} needs root"})
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    return uid, gid


def sandbox_uid(sandbox_id: str, leases: LeaseRegistry) -> int:
    """Derived from the id, re-drawn while a live lease on this host holds the same."""
    taken = {
        lease.resources.get("uid")
        for _, lease in leases.all()
        if lease is not None and lease.sandbox_id != sandbox_id
    }
    for salt in range(64):
        digest = hashlib.sha256(f"{salt}:{sandbox_id}".encode()).digest()
        uid = SANDBOX_UID_BASE + int.from_bytes(digest[:8], "big") % SANDBOX_UID_SPAN
        if uid not in taken:
            return uid
    raise ProvisionError("no free sandbox uid (too many live sandboxes?)")


def plan(host: HostSupport, config: SandboxLifecycleConfig, uid: int) -> Plan:
    """Which mechanism provides each layer for ``config`` here, and why a layer is not."""
    iso = config.isolation
    report: dict[str, str] = dict.fromkeys(MECHANISMS, "")
    report["rlimits"] = host.rlimits[1]
    if not iso.use_cgroups:
        report["cgroup"] = "disabled by sandbox.isolation.useCgroups"
    elif not host.cgroup.available:
        report["cgroup"] = host.cgroup.reason
    launcher, bwrap_path, ns_reason = _namespaces(host, config, uid)
    for m in NAMESPACES:
        report[m] = ns_reason
    network = "none"
    if config.network:
        if launcher is None:
            network = "host"
        elif host.pasta is None:
            network = "host"
            report["net-namespace"] = (
                "--network needs pasta to keep the sandbox off the host's loopback "
                "(apt-get install passt)"
            )
        elif not os.access(TUN_DEVICE, os.R_OK | os.W_OK):
            network = "host"
            report["net-namespace"] = (
                f"--network needs pasta, which cannot open {TUN_DEVICE} as this user "
                "(run as root, or make it mode 0666 as most distributions do)"
            )
        else:
            network = "pasta"
    if not iso.seccomp:
        report["seccomp"] = "disabled by sandbox.isolation.seccomp"
    else:
        report["seccomp"] = host.seccomp[1]
    if not iso.tmpfs_workspace:
        report["tmpfs-workspace"] = "disabled by sandbox.isolation.tmpfsWorkspace"
    elif not host.tmpfs[0]:
        report["tmpfs-workspace"] = host.tmpfs[1]
    if uid == 0:
        report["unprivileged-user"] = "sandbox runs as root (isolation.runAsUser)"
    fallbacks = limit_fallbacks(config, uid) if report["cgroup"] else ()
    return Plan(report, launcher, bwrap_path, network, fallbacks)


def limit_fallbacks(config: SandboxLifecycleConfig, uid: int) -> tuple[str, ...]:
    """What the memory and process limits become without a cgroup, said plainly: both
    still hold, but not as the cgroup would hold them."""
    q = config.quotas
    out: list[str] = []
    if q.address_space_bytes is None:
        out.append(
            f"memory: without a memory cgroup the memory limit ({q.memory_bytes} bytes) is "
            "RLIMIT_AS, a cap on address space rather than resident memory: a task over it "
            "sees allocations fail (MemoryError, ENOMEM) instead of a kill with 137, and "
            "runtimes that reserve address space up front (Node.js, the JVM, Go) may not "
            "start under it"
        )
    if uid == 0:
        out.append("processes: RLIMIT_NPROC does not hold root: no process limit")
    elif not is_sandbox_uid(uid):
        out.append(
            f"processes: without a pids cgroup the process limit is RLIMIT_NPROC of uid "
            f"{uid}, which the sandbox shares: each command may start "
            f"{q.process_count_limit} beyond the processes that uid already runs (those "
            "this host can see: processes of the uid in other containers that share the "
            "user namespace count too)"
        )
    return tuple(out)


def _namespaces(
    host: HostSupport, config: SandboxLifecycleConfig, uid: int
) -> tuple[str | None, str | None, str]:
    """(launcher, bwrap path, why there are no namespaces): bwrap first, else our
    unshare(2) launcher."""
    iso = config.isolation
    if not iso.namespaces:
        return None, None, "disabled by sandbox.isolation.namespaces"
    why: list[str] = []
    if iso.use_bwrap:
        bw = host.bwrap_for(uid)
        if bw.works:
            return "bwrap", bw.path, ""
        why.append(bw.reason)
    else:
        why.append("bwrap disabled by sandbox.isolation.useBwrap")
    ok, reason = host.nsinit_for(uid)
    if ok:
        return "unshare", None, ""
    why.append(reason)
    return None, None, "; ".join(why)


def check_required(report: Mapping[str, str], required: Sequence[str]) -> None:
    """Refuse when a mechanism the config requires (``isolation.required``) is missing."""
    missing = {m: report.get(m, "unknown mechanism") for m in required if report.get(m, "?")}
    if missing:
        raise IsolationUnavailableError(missing)

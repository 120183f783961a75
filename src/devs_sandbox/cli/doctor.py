"""``devs-sandbox doctor`` and ``cleanup``: what this host supports, and reaping leftovers.

The doctor answers, per mechanism, "in effect for a default run here?" and if
not, why not and what to do, so that a user on a laptop (cgroup v2, no root)
knows exactly which guarantee they are missing.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devs_sandbox.config import DevsConfig, default_db_path
from devs_sandbox.isolation import reprobe

logger = logging.getLogger(__name__)

_NS_HINT = (
    "apt-get install bubblewrap, or run as root (unshare(2) namespaces), or allow "
    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
)
HINTS = {
    "cgroup": "run as root on a host with the memory and pids controllers",
    "pid-namespace": _NS_HINT,
    "mount-namespace": _NS_HINT,
    "net-namespace": _NS_HINT + "; for --network: apt-get install passt",
    "seccomp": "pip install pyseccomp, apt-get install libseccomp2",
    "tmpfs-workspace": "run as root",
    "unprivileged-user": "run as root so sandboxes can drop to nobody, or leave runAsUser=auto",
    "rlimits": "Linux only",
}
# Without these a default run is refused (unless the operator allows weaker isolation).
PROMISED = ("pid-namespace", "mount-namespace", "net-namespace", "seccomp")


def diagnose(config: DevsConfig) -> dict[str, Any]:
    """Machine-readable report: host facts, and each mechanism's status and reason."""
    from devs_sandbox.drivers.process import ProcessDriver  # noqa: PLC0415

    host = reprobe()  # never the cached verdicts: this is where an operator checks them
    driver = ProcessDriver(host=host)
    report = driver.isolation_report(config.sandbox)
    hints = dict(HINTS)
    if host.euid == 0:
        hints["cgroup"] = (
            "the cgroup filesystem is not writable here (a container?): run on the host, or "
            "give the container a writable cgroup mount"
        )
        hints["tmpfs-workspace"] = "root here lacks CAP_SYS_ADMIN (a container?)"
    mechanisms = {
        name: {"available": not why, "reason": why, "hint": hints.get(name, "") if why else ""}
        for name, why in report.items()
    }
    cg = host.cgroup
    cgroup_info: dict[str, Any] = {
        "version": cg.version,
        "reason": cg.reason,
        "controllers": list(cg.controllers),
        "unified_mount": str(cg.unified) if cg.unified else None,
        "v1_mounts": {k: str(v) for k, v in cg.mounts.items()},
    }
    uid, _ = driver.sandbox_user(config.sandbox)
    bw = host.bwrap_for(uid)
    launcher = driver.namespace_launcher(config.sandbox)
    unshare_ok, unshare_why = host.nsinit_for(uid)
    db = config.store.path or default_db_path()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "euid": host.euid,
        "sandbox_uid": uid,
        "cgroup": cgroup_info,
        "bwrap": {"path": bw.path, "works": bw.works, "version": bw.version, "reason": bw.reason},
        "unshare": {"works": unshare_ok, "reason": unshare_why},
        "namespaces_via": launcher,
        "pasta": host.pasta,
        "mechanisms": mechanisms,
        "refused_by_default": [m for m in PROMISED if report.get(m)],
        "store": {"path": str(db), "writable": _writable(db)},
        "docker": _docker_status(),
    }


def _writable(path: Path) -> bool:
    """Could the store be created or written at ``path`` (nearest existing ancestor)?"""
    if path.exists():
        return os.access(path, os.W_OK)
    d = path.parent
    while not d.exists():
        if d.parent == d:
            return False
        d = d.parent
    return os.access(d, os.W_OK)


def _docker_status() -> dict[str, Any]:
    try:
        import docker  # noqa: PLC0415
    except ImportError:
        return {"available": False, "reason": "pip install 'devs-sandbox[docker]'"}
    try:
        client = docker.from_env(timeout=3)
        version = client.version().get("Version", "?")
        client.close()
    except Exception as exc:
        return {"available": False, "reason": f"engine not reachable: {exc}"}
    return {"available": True, "version": version, "reason": ""}


def who(report: dict[str, Any]) -> str:
    from devs_sandbox.isolation import SANDBOX_UID_BASE  # noqa: PLC0415

    uid = report["sandbox_uid"]
    if uid == SANDBOX_UID_BASE:
        return f"a uid of their own each, from {SANDBOX_UID_BASE}"
    return f"uid {uid}"


def mechanism_detail(report: dict[str, Any], name: str) -> str:
    """How an available mechanism is provided (cgroup version, bwrap's version, pasta)."""
    detail = ""
    if name == "cgroup":
        detail = f"v{report['cgroup']['version']}"
    elif name.endswith("namespace"):
        via = report["namespaces_via"]
        detail = str(report["bwrap"]["version"]).strip() if via == "bwrap" else via or ""
        if name == "net-namespace":
            pasta = report["pasta"]
            detail += f" (--network: pasta {pasta})" if pasta else " (--network: no pasta)"
    return detail


def render(report: dict[str, Any]) -> str:
    lines = [
        f"devs-sandbox doctor (python {report['python']}, euid {report['euid']}, "
        f"sandboxes run as {who(report)})",
        "",
    ]
    for name, info in report["mechanisms"].items():
        if info["available"]:
            lines.append(f"  {name:<18} yes  {mechanism_detail(report, name)}".rstrip())
        else:
            lines.append(f"  {name:<18} no   {info['reason']}")
            if info["hint"]:
                lines.append(f"  {'':<18}      -> {info['hint']}")
    if report["refused_by_default"]:
        lines.append(
            f"  -> a default run is refused here ({', '.join(report['refused_by_default'])} "
            "missing) unless --allow-weaker-isolation"
        )
    docker = report["docker"]
    docker_line = (
        "yes  " + docker.get("version", "") if docker["available"] else "no   " + docker["reason"]
    )
    lines.append(f"  {'docker':<18} {docker_line}")
    store = report["store"]
    lines.append(
        f"  {'store':<18} {store['path']} ({'writable' if store['writable'] else 'NOT writable'})"
    )
    return "\n".join(lines) + "\n"


def cleanup_all(config: DevsConfig, drivers: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Reap orphans of ``drivers`` (default: every driver that can be loaded here; the
    kubernetes one only when the config names it, since it reaches a cluster)."""
    from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: PLC0415

    reaped: dict[str, list[str]] = {}
    manager = SandboxLifecycleManager(config=config, store=None, reap_orphans=False)
    if drivers is None:
        drivers = ("process", "docker")
        if config.sandbox.driver == "kubernetes":
            drivers = (*drivers, "kubernetes")
    try:
        for name in drivers:
            try:
                driver = manager.driver_for(config.sandbox.model_copy(update={"driver": name}))
            except Exception as exc:  # e.g. the docker SDK not installed: nothing to reap
                logger.debug("no %s driver here: %s", name, exc)
                continue
            ids = manager.reap_orphans(driver)
            if ids:
                reaped[name] = ids
    finally:
        manager.shutdown()
    return reaped

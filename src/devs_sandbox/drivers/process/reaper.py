"""Removing a sandbox by id (its cgroups, its tmpfs, its directory), and finding the
sandboxes whose owner died: by lease, and, for leftovers without one, by age and idleness.
Ids come from names in shared directories: each is validated before it becomes a path."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

from devs_sandbox.drivers.linux import age_s, remove_tree
from devs_sandbox.drivers.process.state import WORKSPACE_PREFIX
from devs_sandbox.isolation import HostSupport, mounts
from devs_sandbox.isolation.cgroups import SandboxCgroup, list_sandbox_cgroups
from devs_sandbox.leases import LeaseRegistry
from devs_sandbox.models import SANDBOX_ID_PATTERN

logger = logging.getLogger(__name__)


def destroy_resources(
    host: HostSupport, sandbox_id: str, root: Path, cgroup: SandboxCgroup | None = None
) -> list[str]:
    """Remove by id whatever exists under the sandbox's ``root`` (its tmpfs and every area
    in it) and its cgroups; ``cgroup`` narrows the search when we know it. Returns what
    could not be removed."""
    left: list[str] = []
    if cgroup is not None:
        left += cgroup.remove()
    elif host.cgroup.available:
        left += SandboxCgroup.from_paths(host.cgroup, sandbox_id).remove()
    if root.exists() or root.is_symlink():
        # Only root can have mounted it; umount2 on a plain directory is a cheap EINVAL,
        # cheaper than scanning /proc/self/mountinfo.
        if host.tmpfs[0] and not root.is_symlink():
            try:
                mounts.unmount(root)
            except OSError as exc:
                left.append(str(exc))
        left += remove_tree(root)
    return left


def _valid(sandbox_id: str) -> bool:
    # A directory named ``devs-sandbox-..`` must not make the root cgroup a "sandbox".
    return bool(SANDBOX_ID_PATTERN.fullmatch(sandbox_id)) and sandbox_id not in {".", ".."}


def reap_orphans(
    *,
    driver_name: str,
    leases: LeaseRegistry,
    host: HostSupport,
    workspace_root: Path,
    live: Collection[str],
    lease_grace_s: float,
    destroy: Callable[[str, Path], list[str]],
) -> list[str]:
    """Destroy sandboxes whose owner died; also lease-less leftovers past the grace.
    ``live``: ids this process holds; ``destroy(id, root)`` removes one and returns what
    it could not. One bad entry never stops the rest."""
    reaped: list[str] = []
    for sandbox_id, lease in leases.orphans():
        if lease is not None and lease.driver != driver_name:
            continue
        if not _valid(sandbox_id):
            continue
        workspace = workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
        if lease is not None and Path(lease.workspace) != workspace:
            workspace = Path(lease.workspace)
            if not workspace.name.startswith(WORKSPACE_PREFIX):
                continue  # a lease naming a path that is not a workspace: leave it
        try:
            if not destroy(sandbox_id, workspace):
                leases.remove(sandbox_id)
                reaped.append(sandbox_id)
        except Exception:
            logger.exception("reaping orphan sandbox %s failed", sandbox_id)
    # Lease-less leftovers (a lease lost to a full disk, an older version): taken only when
    # old AND idle. A live sandbox is never young-and-leaseless (its lease is written
    # first), and one whose lease we cannot see still has processes or recent changes
    # while it works.
    leased = {sid for sid, _ in leases.all()}
    now = time.time()
    candidates: set[str] = set()
    if host.cgroup.available:
        candidates |= list_sandbox_cgroups(host.cgroup)
    with contextlib.suppress(OSError):
        for p in workspace_root.iterdir():
            if p.name.startswith(WORKSPACE_PREFIX) and p.is_dir() and not p.is_symlink():
                candidates.add(p.name[len(WORKSPACE_PREFIX) :])
    for sandbox_id in sorted(candidates - leased - set(live)):
        if not _valid(sandbox_id):
            continue
        workspace = workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
        cg = SandboxCgroup.from_paths(host.cgroup, sandbox_id) if host.cgroup.available else None
        paths = [workspace, *(cg.paths if cg is not None else [])]
        if min(age_s(p, now) for p in paths) < lease_grace_s:
            continue
        if cg is not None and cg.exists() and cg.pids():
            continue  # processes run in it: somebody's live sandbox, lease or not
        try:
            if not destroy(sandbox_id, workspace):
                reaped.append(sandbox_id)
        except Exception:
            logger.exception("reaping leftover sandbox %s failed", sandbox_id)
    return reaped

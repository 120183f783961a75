"""Host isolation mechanisms, probed once per process: cgroups, bubblewrap, our unshare(2)
launcher, seccomp, pasta, tmpfs, rlimits.

``probe_host`` is what ``devs-sandbox doctor`` prints and what the process driver
consults before each provision: for every mechanism, whether it works here and,
if not, why not. Probes that spawn a process (bwrap, nsinit) run lazily, the first
time a sandbox needs that mechanism.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
from dataclasses import dataclass

from devs_sandbox.isolation import bwrap, cgroups, mounts, probe_cache, unshare

NOBODY_UID = 65534
NOBODY_GID = 65534
# Per-sandbox uids ("auto" as root): below 2**31, since bwrap parses uids as signed ints,
# and far from distributions' user and subuid ranges.
SANDBOX_UID_BASE = 1_600_000_000
SANDBOX_UID_SPAN = 1 << 24


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is one of the uids root hands out, one per sandbox (else it is
    shared: the caller's own, nobody, or one the operator named)."""
    return SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_UID_SPAN


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv")


def drop_privileges_argv(uid: int, gid: int) -> list[str]:
    """setpriv (util-linux) switching to ``uid``: run after the parent has set the shim's
    rlimits (same uid, so no CAP_SYS_RESOURCE needed) and before bwrap. It sets
    no_new_privs, so setuid binaries on the host cannot lift the sandbox back to root."""
    setpriv = _setpriv()
    if setpriv is None:
        return []
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@dataclass(frozen=True, slots=True)
class HostSupport:
    euid: int
    cgroup: cgroups.CgroupSupport
    bwrap_root: bwrap.BwrapSupport
    tmpfs: tuple[bool, str]
    rlimits: tuple[bool, str]

    def bwrap_for(self, uid: int) -> bwrap.BwrapSupport:
        """bwrap as root works differently from bwrap as an unprivileged uid (user ns).
        One probe stands for every unprivileged uid: they differ in nothing bwrap checks."""
        if uid == self.euid:
            return self.bwrap_root
        return bwrap.probe(tuple(drop_privileges_argv(SANDBOX_UID_BASE, SANDBOX_UID_BASE)))

    def nsinit_for(self, uid: int) -> tuple[bool, str]:
        """Whether our unshare(2) launcher can make namespaces here: as root directly, as
        anyone else through a user namespace of their own."""
        probe_uid = uid if uid == self.euid else SANDBOX_UID_BASE  # one probe for them all
        return unshare.probe(userns=self.euid != 0, uid=probe_uid)

    @property
    def seccomp(self) -> tuple[bool, str]:
        from devs_sandbox.isolation import seccomp  # noqa: PLC0415 - imports libseccomp

        return seccomp.probe()

    @property
    def pasta(self) -> str | None:
        """pasta (Debian: passt), the user-mode network a sandbox gets with --network."""
        return _pasta()


@functools.cache
def _pasta() -> str | None:
    return shutil.which("pasta")


def _rlimits() -> tuple[bool, str]:
    if not hasattr(resource, "prlimit"):
        return False, "resource.prlimit unavailable on this platform"
    return True, ""


def reprobe() -> HostSupport:
    """Forget every verdict, in this process and on disk, and probe again (the doctor)."""
    probe_cache.invalidate()
    for fn in (bwrap.probe, unshare.probe, mounts.can_mount, probe_host):
        fn.cache_clear()
    return probe_host()


@functools.cache
def probe_host() -> HostSupport:
    euid = os.geteuid()
    return HostSupport(
        euid=euid,
        cgroup=cgroups.detect(),
        bwrap_root=bwrap.probe(),
        tmpfs=mounts.can_mount(),
        rlimits=_rlimits(),
    )

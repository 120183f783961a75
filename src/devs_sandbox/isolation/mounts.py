"""A size- and inode-capped tmpfs for the workspace, mounted and unmounted without a subprocess.

Why tmpfs: ``nr_inodes`` makes the kernel refuse the file past the quota
(ENOSPC), so a file bomb cannot overshoot between two polls, and ``statvfs``
then counts the files in O(1). ``size`` caps the bytes. tmpfs pages are charged
to the memory cgroup of the process that writes them, so the sandbox's memory
cap bounds the workspace too.

mount(2) needs CAP_SYS_ADMIN on the host, i.e. root; ``can_mount`` says so up front.
Kernel docs: Documentation/filesystems/tmpfs.rst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from devs_sandbox.isolation import probe_cache

MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MNT_DETACH: Final = 0x2
UMOUNT_NOFOLLOW: Final = 0x8  # the target may sit in a world-writable directory

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc  # noqa: PLW0603 - one libc handle per process
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return _libc


@functools.cache
def can_mount() -> tuple[bool, str]:
    """Whether we can mount a tmpfs here: tried once, for real, on a scratch directory.
    Being root is not enough: a container's root usually lacks CAP_SYS_ADMIN. The verdict
    is kept on disk for the next processes (``probe_cache``)."""
    return probe_cache.cached(
        "tmpfs", can_mount_now, encode=list, decode=lambda v: (bool(v[0]), str(v[1]))
    )


def can_mount_now() -> tuple[bool, str]:
    """The probe itself, never cached."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "mounting a tmpfs needs root (CAP_SYS_ADMIN)"
    try:
        _lib()
    except OSError as exc:
        return False, f"libc not loadable: {exc}"
    scratch = Path(tempfile.mkdtemp(prefix="devs-mount-probe-"))
    try:
        try:
            mount_tmpfs(scratch, TmpfsOptions(64 * 1024, 16, 0, 0))
        except OSError as exc:
            return False, f"mounting a tmpfs failed: {exc.strerror} (root without CAP_SYS_ADMIN?)"
        unmount(scratch)
    finally:
        scratch.rmdir()
    return True, ""


@dataclass(frozen=True, slots=True)
class TmpfsOptions:
    size_bytes: int
    nr_inodes: int
    uid: int
    gid: int
    mode: int = 0o700

    def render(self) -> str:
        return (
            f"size={self.size_bytes},nr_inodes={self.nr_inodes},"
            f"mode={self.mode:o},uid={self.uid},gid={self.gid}"
        )


def mount_tmpfs(target: Path, options: TmpfsOptions) -> None:
    """Mount a fresh tmpfs on ``target`` (nosuid, nodev); OSError on failure."""
    rc = _lib().mount(
        b"devs-sandbox",
        os.fsencode(target),
        b"tmpfs",
        MS_NOSUID | MS_NODEV,
        options.render().encode(),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    """Lazy-unmount ``target``; a target that is not a mount point is fine.

    UMOUNT_NOFOLLOW: in /tmp a local user could swap our directory for a symlink to any
    mount point between our checks and this call; the kernel then refuses to follow it.
    """
    rc = _lib().umount2(os.fsencode(target), MNT_DETACH | UMOUNT_NOFOLLOW)
    if rc != 0:
        err = ctypes.get_errno()
        # EINVAL: not a mount point; ENOENT: gone already. Both mean nothing to undo.
        if err not in (22, 2):
            raise OSError(err, f"umount {target}: {os.strerror(err)}")

"""The process driver's syscall filter: kernel surfaces a sandbox must not share.

Modelled on Docker's default seccomp profile, as a deny list on top of "allow" (an
allow list would break whatever toolchain an agent runs): the filter refuses, with
EPERM, the syscalls that reach state shared with the host or that enlarge the
kernel's attack surface for no build or test a sandbox runs:

- keyrings (``keyctl``, ``add_key``, ``request_key``): keys are not namespaced, and a
  process that inherits the caller's session keyring possesses it whatever its uid
  (keyrings(7), "possession"); Docker's profile refuses them for the same reason;
- new user namespaces (``unshare``/``clone`` with CLONE_NEWUSER, ``setns``;
  ``clone3`` answers ENOSYS so libc falls back to ``clone``, whose flags a filter can
  read): inside one, an unprivileged task gains every capability over fresh
  namespaces, the way most recent container escapes began;
- ``io_uring_*``, ``bpf``, ``perf_event_open``, ``userfaultfd``: large, frequently
  exploited kernel interfaces (Docker and ChromeOS refuse them too);
- the mount family (``mount``, ``umount2``, ``pivot_root``, the new mount API),
  ``kexec_*``, module loading, ``reboot``, swap, ``acct``, ``quotactl``, clock
  setting, ``open_by_handle_at`` (the "shocker" escape), ``iopl``/``ioperm``;
- ``ptrace`` and ``process_vm_*`` when the sandbox has no pid namespace of its own
  (with one, only the sandbox's own processes are visible, so debuggers keep
  working);
- the TIOCSTI and TIOCLINUX ioctls, which push input into a terminal.

The filter is built with libseccomp (the official Python bindings where the
distribution ships them, else ``pyseccomp``, a ctypes binding with the same API),
never as hand-written BPF, and exported as a BPF program that bubblewrap
(``--seccomp FD``) or our unshare launcher loads right before the command's
``execve``. Building it costs ~0.5 ms; importing the binding ~30 ms (ctypes looks
up the library), so programs are cached per process.

seccomp(2), seccomp_rule_add(3), https://docs.docker.com/engine/security/seccomp/
"""

from __future__ import annotations

import errno
import functools
import hashlib
import platform
from dataclasses import dataclass
from typing import Any, Final

CLONE_NEWUSER: Final = 0x10000000
TIOCSTI: Final = 0x5412
TIOCLINUX: Final = 0x541C

# Refused everywhere (EPERM). Names unknown to the running libseccomp (a syscall newer
# than it) are skipped: the kernel it was built for cannot have them either... unless
# the library is older than the kernel, which ``profile_summary`` reports.
DENIED: Final = (
    # keyrings
    "keyctl",
    "add_key",
    "request_key",
    # namespaces: joining one (setns); creating user namespaces is filtered by flag below
    "setns",
    # large kernel interfaces
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    # the mount family
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # the machine itself
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "lookup_dcookie",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "vhangup",
    "nfsservctl",
    "uselib",
)
# Refused when the sandbox shares the caller's pid namespace.
DENIED_WITHOUT_PIDNS: Final = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp")


class SeccompUnavailableError(RuntimeError):
    """libseccomp (or a binding to it) is missing; the message says what to install."""


@dataclass(frozen=True, slots=True)
class Profile:
    """Which variant of the filter a sandbox gets."""

    pid_namespace: bool = True

    @property
    def key(self) -> str:
        return "pidns" if self.pid_namespace else "nopidns"


def _binding() -> Any:
    try:
        import seccomp  # noqa: PLC0415 - Debian's python3-seccomp, the official binding
    except ImportError:
        pass
    else:
        return seccomp
    try:
        import pyseccomp  # noqa: PLC0415 - ctypes binding with the official API
    except (ImportError, OSError) as exc:
        raise SeccompUnavailableError(
            f"no libseccomp binding: {exc} (pip install pyseccomp; apt-get install libseccomp2)"
        ) from None
    return pyseccomp


def _compat_arches(sc: Any) -> list[Any]:
    """32-bit ABIs a 64-bit process can call into (int 0x80, x32): each gets the same
    rules, or a task would bypass the filter through them. Without it libseccomp kills
    any syscall of a foreign ABI (its default bad-arch action), which is also safe."""
    machine = platform.machine()
    names = {"x86_64": ("X86", "X32"), "aarch64": ("ARM",)}.get(machine, ())
    return [getattr(sc.Arch, n) for n in names if hasattr(sc.Arch, n)]


@functools.cache
def build_bpf(profile: Profile = Profile()) -> bytes:
    """The compiled BPF program (struct sock_filter[]) for ``profile``."""
    sc = _binding()
    eperm = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for arch in _compat_arches(sc):
        try:
            f.add_arch(arch)
        except (OSError, RuntimeError, ValueError):
            continue  # the kernel or library lacks that ABI: it then cannot be used either
    denied = list(DENIED)
    if not profile.pid_namespace:
        denied += DENIED_WITHOUT_PIDNS
    for name in denied:
        _add(sc, f, eperm, name)
    # New user namespaces, by flag: unshare(flags) and clone(flags, ...) (argument 0 on
    # every ABI we add; the s390 clone argument order does not concern these arches).
    newuser = sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
    _add(sc, f, eperm, "unshare", newuser)
    _add(sc, f, eperm, "clone", newuser)
    # clone3 passes its flags in a struct a filter cannot read: ENOSYS makes glibc (2.34+)
    # and musl fall back to clone, as under Docker's profile.
    _add(sc, f, sc.ERRNO(errno.ENOSYS), "clone3")
    for request in (TIOCSTI, TIOCLINUX):
        _add(sc, f, eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return _export(f)


def _add(sc: Any, f: Any, action: int, name: str, *args: Any) -> None:
    try:
        f.add_rule(action, name, *args)
    except (ValueError, RuntimeError, OSError) as exc:
        # libseccomp does not know the name (older than the syscall): skip it; the kernel
        # this library targets has no such entry point to reach.
        if "name" in str(exc).lower() or isinstance(exc, ValueError):
            return
        raise


def _export(f: Any) -> bytes:
    import os  # noqa: PLC0415

    # export_bpf wants a file object with a real descriptor; a memfd never touches disk.
    fd = os.memfd_create("devs-sandbox-seccomp", os.MFD_CLOEXEC)
    try:
        with open(fd, "w+b", closefd=False) as fo:
            f.export_bpf(fo)
            fo.flush()
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    program = b"".join(chunks)
    if not program or len(program) % 8:
        raise SeccompUnavailableError(
            f"libseccomp exported a malformed program ({len(program)} bytes)"
        )
    return program


def probe() -> tuple[bool, str]:
    """(True, "") when a filter can be built here, else (False, why)."""
    try:
        build_bpf(Profile())
    except SeccompUnavailableError as exc:
        return False, str(exc)
    except Exception as exc:  # a broken library must not crash the doctor
        return False, f"building the seccomp filter failed: {exc}"
    return True, ""


def fingerprint(profile: Profile = Profile()) -> str:
    """A short digest of the program, for reports and caches."""
    return hashlib.sha256(build_bpf(profile)).hexdigest()[:16]

"""What every driver that starts Linux processes shares: the start shim, the sandbox's
PATH, exit statuses, and removing a sandbox's leftovers from a shared directory.

The process driver runs the shim on the host, the Docker driver inside its container;
both read a command's end the same way (a signal as 128 + N, as shells and engines
report it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Final

DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_SIGNAL: Final = 64

# The shim waits on its stdin (a pipe) for the parent to finish setting limits, then
# becomes the command. $0 is a label; $1 says whether the caller gave stdin (else the
# command gets /dev/null); the rest is the real argv. dash's read builtin takes one
# byte at a time from a pipe, so it never swallows the caller's data after "go".
# PWD is the only variable dash adds to the environment.
# $1: stdin given (1) or /dev/null (0); $2: how many cgroup v1 ``tasks`` files follow,
# into each of which the shim writes "0" (itself). Why the shim and not the parent: a
# parent writing a pid into cgroup.procs takes the global cgroup_threadgroup_rwsem for
# writing, which waits for an RCU grace period (10-25 ms here whenever the lock was idle,
# i.e. on most runs); a thread moving itself through ``tasks`` skips that lock
# (kernel/cgroup/cgroup.c, cgroup_procs_write_start). The shim is single-threaded, so
# its one thread is the whole process, and all it forks later inherits the cgroups.
SHIM: Final = (
    "read -r _ || exit 125; s=$1; n=$2; shift 2; "
    'while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n - 1)); done; '
    'unset PWD; if [ "$s" = 0 ]; then exec "$@" </dev/null; fi; exec "$@"'
)
SHIM_NAME: Final = "devs-sandbox-shim"

# The layers a host can give a sandbox, by the name results report them under.
HOST_MECHANISMS: Final = (
    "rlimits",
    "cgroup",
    "pid-namespace",
    "mount-namespace",
    "net-namespace",
    "seccomp",
    "tmpfs-workspace",
    "unprivileged-user",
)


def exit_code_from_status(status: int) -> tuple[int, int | None]:
    """A wait status as (shell-style exit code, killing signal or None)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


def signal_from_code(code: int) -> int | None:
    """The signal a launcher (bwrap, an engine, a shell) reported as 128 + N, if any."""
    return code - 128 if 128 < code <= 128 + MAX_SIGNAL else None


def age_s(path: Path, now: float) -> float:
    """Seconds since ``path`` last changed; a missing path is infinitely old."""
    try:
        st = path.lstat()
    except OSError:
        return float("inf")
    return now - max(st.st_mtime, st.st_ctime)


def remove_tree(path: Path) -> list[str]:
    """rmtree that never follows a symlink and, as root, never chmods a path: in the
    world-writable temp directory a local user may swap entries while we work. Returns
    what could not be removed (empty: all gone)."""
    errors: list[str] = []
    as_root = os.geteuid() == 0

    def onexc(_func: object, p: str, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            return  # a concurrent destroy (two reapers) got there first
        if as_root or Path(p) == path:
            errors.append(f"{p}: {getattr(exc, 'strerror', None) or exc}")
            return
        # Not root: a task may leave a directory mode 000 inside the tree; as its owner we
        # may open it up and retry (never the workspace's parent, the shared /tmp).
        try:
            Path(p).parent.chmod(0o700)
            if Path(p).is_dir() and not Path(p).is_symlink():
                Path(p).chmod(0o700)
                shutil.rmtree(p)
            else:
                Path(p).unlink()
        except FileNotFoundError:
            pass
        except OSError as again:
            errors.append(f"{p}: {again.strerror or exc}")

    try:
        if path.is_symlink():
            path.unlink()
            return errors
        try:
            path.rmdir()  # the usual case: an unmounted tmpfs leaves an empty directory
        except OSError:
            shutil.rmtree(path, onerror=lambda f, p, e: onexc(f, p, e[1]))
    except OSError as exc:  # e.g. swapped for a file between our checks
        errors.append(f"{path}: {exc}")
    if path.exists() or path.is_symlink():
        errors.append(f"{path}: still present")
    return errors


def count_session(sid: int) -> int | None:
    """Processes in session ``sid`` (an exec's leader); the count without a pids cgroup."""
    try:
        import psutil  # noqa: PLC0415 - only needed on hosts without a pids cgroup
    except ImportError:
        return None
    n = 0
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                n += 1
    return n


# What bwrap prints, and exits 1 with, when it cannot execute the command (its
# die_with_error("execvp %s", argv0) with strerror); nothing else of it reaches the task's
# stderr once the sandbox is set up.
_BWRAP_EXEC_FAILED: Final = "bwrap: execvp {argv0}: "
EXIT_NOT_EXECUTABLE: Final = 126
EXIT_NOT_FOUND: Final = 127
_NOT_FOUND_ERRORS: Final = ("No such file or directory", "Not a directory")


def bwrap_exec_failure(argv0: str, code: int, stderr: str) -> int | None:
    """The shell's status (127 not found, 126 not executable) for a command bwrap could
    not execute, as ``timeout(1)`` and ``docker run`` report it; None for anything else.

    Only bwrap's own one-line message with exit 1 counts. A task that prints exactly that
    line and exits 1 is reported as 126/127: its own doing, and no more than ``exit 127``.
    """
    prefix = _BWRAP_EXEC_FAILED.format(argv0=argv0)
    if code != 1 or not stderr.startswith(prefix) or stderr.count("\n") > 1:
        return None
    reason = stderr[len(prefix) :].strip()
    return EXIT_NOT_FOUND if reason in _NOT_FOUND_ERRORS else EXIT_NOT_EXECUTABLE

"""Namespaces through bubblewrap: pid, net, mount, ipc, uts.

Why bwrap rather than our own clone(2): it is small, audited, packaged everywhere
(Debian: ``bubblewrap``), works unprivileged through user namespaces, and its
``--die-with-parent`` plus a pid namespace make the kill total: when the
namespace's init dies the kernel SIGKILLs every process left in it
(pid_namespaces(7)), setsid and double-forks included.

Mount layout inside: the host root read-only, the paths in ``hide_paths`` (home
directories, the Docker socket) covered by empty tmpfs, a private /tmp and
/var/tmp, fresh /proc and /dev (with its own /dev/shm), and the workspace bound
read-write at its host path.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PROBE_TIMEOUT_S: Final = 5.0  # a healthy bwrap answers in ~5 ms; 5 s means it is wedged


@dataclass(frozen=True, slots=True)
class BwrapSupport:
    path: str | None
    works: bool
    reason: str = ""
    version: str = ""


@functools.cache
def probe(prefix: tuple[str, ...] = ()) -> BwrapSupport:
    """Run a trivial sandbox once, behind ``prefix`` (e.g. setpriv dropping to the sandbox
    uid), to learn whether bwrap works here the way the driver will run it."""
    path = shutil.which("bwrap")
    if path is None:
        return BwrapSupport(None, False, "bwrap not found on PATH (apt-get install bubblewrap)")
    try:
        version = subprocess.run(
            [path, "--version"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapSupport(path, False, f"bwrap --version failed: {exc}")
    argv = [
        *prefix,
        path,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--",
        "/bin/true",
    ]
    if not prefix and os.geteuid() == 0:
        argv[1:1] = ["--cap-drop", "ALL"]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapSupport(path, False, f"bwrap failed to start: {exc}", version)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return BwrapSupport(
            path,
            False,
            f"bwrap cannot create namespaces here: {why[0]} "
            "(unprivileged user namespaces disabled?)",
            version,
        )
    return BwrapSupport(path, True, "", version)


@functools.lru_cache(maxsize=64)
def hide_args(hide_paths: tuple[str, ...]) -> tuple[str, ...]:
    """bwrap arguments covering ``hide_paths``; cached: the host layout does not change
    between two execs, and resolving it costs more than the rest of the argv."""
    out: list[str] = []
    # bwrap does not follow symlinks in a destination: resolve /var/run/... to /run/...
    for hidden in dict.fromkeys(os.path.realpath(h) for h in hide_paths):
        p = Path(hidden)
        if p.is_dir():
            out += ["--tmpfs", hidden]
        elif p.exists():
            # A file (a socket) cannot take a tmpfs; bind /dev/null over it instead.
            out += ["--ro-bind", "/dev/null", hidden]
    return tuple(out)


def build_argv(
    bwrap: str,
    *,
    workspace: Path,
    network: bool,
    hide_paths: Sequence[str],
    drop_caps: bool,
    command: Sequence[str],
    extra_binds: Sequence[tuple[str, str]] = (),
    data_files: Mapping[str, int] | None = None,
    args_fd: int | None = None,
) -> list[str]:
    """The bwrap command line for one exec. ``args_fd``: more arguments, NUL-separated,
    read by bwrap from that fd (the environment as --clearenv/--setenv: off argv, and
    never bwrap's own environment)."""
    ws = str(workspace)
    argv = [
        bwrap,
        *(("--args", str(args_fd)) if args_fd is not None else ()),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "devs-sandbox",
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the caller's terminal
        "--ro-bind",
        "/",
        "/",
    ]
    if not network:
        argv.append("--unshare-net")
    if drop_caps:
        argv += ["--cap-drop", "ALL"]
    argv += hide_args(tuple(hide_paths))
    argv += [
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/var/tmp",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--bind",
        ws,
        ws,
    ]
    for src, dest in extra_binds:
        argv += ["--ro-bind", src, dest]
    # Files written from a pipe into the private /tmp (secrets): 0400, in a 0500
    # directory; only the fd number is on the command line. --file writes into the
    # tmpfs directly (--ro-bind-data would add a bind mount per file, ~0.3 ms).
    made_dirs: set[str] = set()
    for dest, fd in (data_files or {}).items():
        parent = str(Path(dest).parent)
        if parent not in made_dirs:
            argv += ["--perms", "0500", "--dir", parent]
            made_dirs.add(parent)
        argv += ["--perms", "0400", "--file", str(fd), dest]
    # The command's environment comes through --args (a memfd), never as --setenv on
    # argv: argv is world-readable in /proc/<pid>/cmdline.
    argv += ["--chdir", ws, "--"]
    argv.extend(command)
    return argv

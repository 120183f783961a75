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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from devs_sandbox.isolation import probe_cache
from devs_sandbox.isolation.layout import Layout, Op

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
    uid), to learn whether bwrap works here the way the driver will run it. The verdict is
    kept on disk for the next processes (``probe_cache``)."""
    return probe_cache.cached(
        "bwrap " + " ".join(prefix),
        lambda: probe_now(prefix),
        encode=lambda s: [s.path, s.works, s.reason, s.version],
        decode=lambda v: BwrapSupport(*v),
    )


def probe_now(prefix: tuple[str, ...] = ()) -> BwrapSupport:
    """The probe itself, never cached (``devs-sandbox doctor``)."""
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
            f"bwrap cannot create namespaces here: {why[0]}",
            version,
        )
    return BwrapSupport(path, True, "", version)


def render(
    bwrap: str,
    layout: Layout,
    *,
    command: Sequence[str],
    network_namespace: bool = True,
    user_namespace: bool = True,
    drop_caps: bool = False,
    seccomp_fd: int | None = None,
    args_fd: int | None = None,
    info_fd: int | None = None,
    block_fd: int | None = None,
) -> list[str]:
    """The bwrap command line for one exec of ``layout``.

    ``user_namespace``: bwrap runs unprivileged (as the sandbox uid), so it makes a user
    namespace anyway; asking for it explicitly lets ``--disable-userns`` forbid the task
    to make more (bubblewrap 0.8+; the seccomp filter forbids it too).
    ``args_fd``: more arguments, NUL-separated, read by bwrap from that fd (the
    environment as --clearenv/--setenv: off argv, which is world-readable in
    /proc/<pid>/cmdline, and never bwrap's own environment).
    ``info_fd``/``block_fd``: bwrap writes the sandbox's pid to ``info_fd`` and waits for
    a byte on ``block_fd`` before the command starts: the window in which the driver
    connects a user-mode network (pasta) to the new network namespace.
    """
    argv = [bwrap]
    if args_fd is not None:
        argv += ["--args", str(args_fd)]
    if user_namespace:
        argv += ["--unshare-user", "--disable-userns"]
    argv += [
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--unshare-net",
        "--hostname",
        layout.hostname,
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the caller's terminal
    ]
    if not network_namespace:
        argv.remove("--unshare-net")
    if drop_caps:
        argv += ["--cap-drop", "ALL"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if block_fd is not None:
        argv += ["--block-fd", str(block_fd)]
    argv += _ops_args(layout.ops)
    argv += ["--chdir", layout.chdir, "--"]
    argv.extend(command)
    return argv


@functools.lru_cache(maxsize=64)
def _static_ops_args(ops: tuple[Op, ...]) -> tuple[str, ...]:
    """Arguments for ops without fds: the host layout does not change between two execs,
    and rendering it costs more than the rest of the argv."""
    return tuple(a for op in ops for a in _one(op))


def _ops_args(ops: tuple[Op, ...]) -> list[str]:
    static = tuple(op for op in ops if op.fd is None)
    if len(static) == len(ops):
        return list(_static_ops_args(ops))
    out: list[str] = []
    for op in ops:
        out += _one(op)
    return out


def _one(op: Op) -> list[str]:
    pre: list[str] = []
    if op.mode is not None and op.kind in ("tmpfs", "dir", "file"):
        pre += ["--perms", f"{op.mode:04o}"]
    if op.size_bytes is not None and op.kind == "tmpfs":
        pre += ["--size", str(op.size_bytes)]
    if op.kind == "ro-bind":
        return [*pre, "--ro-bind", op.src, op.dest]
    if op.kind == "bind":
        return [*pre, "--bind", op.src, op.dest]
    if op.kind == "tmpfs":
        return [*pre, "--tmpfs", op.dest]
    if op.kind == "proc":
        return ["--proc", op.dest]
    if op.kind == "dev":
        return ["--dev", op.dest]
    if op.kind == "dev-null":
        return ["--ro-bind", "/dev/null", op.dest]
    if op.kind == "dir":
        return [*pre, "--dir", op.dest]
    if op.kind == "file":
        assert op.fd is not None
        # --file writes into the tmpfs directly (--ro-bind-data would add a bind mount per
        # file, ~0.3 ms); only the fd number is on the command line.
        return [*pre, "--file", str(op.fd), op.dest]
    raise ValueError(f"unknown layout op {op.kind!r}")

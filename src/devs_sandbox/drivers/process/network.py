"""``--network``: user-mode outbound networking for a sandbox's own network namespace,
through pasta (Debian: passt), started per exec in the window bwrap or nsinit leaves
between making the namespace and running the command (``--info-fd``/``--block-fd``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Final

from devs_sandbox.drivers.linux import SHIM, SHIM_NAME
from devs_sandbox.drivers.process.spawn import PRIVILEGED_ENV
from devs_sandbox.drivers.process.state import Box
from devs_sandbox.errors import DriverError
from devs_sandbox.isolation import unshare

NS_GET_USERNS: Final = 0xB701  # ioctl_ns(2): the user namespace owning a namespace
NETWORK_SETUP_TIMEOUT_S: Final = 10.0  # bwrap reports its pid in ms; pasta starts in ~35 ms
PASTA_STOP_GRACE_S: Final = 1.0  # pasta exits at once on SIGTERM; then SIGKILL


def start_pasta(box: Box, pasta: str, child_pid: int, deadline: float) -> int:
    """Give the sandbox's network namespace user-mode outbound networking: pasta with no
    port forwarding either way and the gateway not mapped to the host (so the host's
    127.0.0.1 and its abstract sockets stay out of reach), in the sandbox's cgroup.
    Returns a pidfd of pasta's daemon, which the exec stops when it ends."""
    netns = f"/proc/{child_pid}/ns/net"
    fds: list[int] = []
    try:
        ns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        fds.append(ns_fd)
        owner_fd = fcntl.ioctl(ns_fd, NS_GET_USERNS)
        fds.append(owner_fd)
        pid_fd = unshare.memfd("devs-sandbox-pasta-pid", b"")
        fds.append(pid_fd)
        argv = [
            pasta,
            "--quiet",
            "--config-net",
            "--no-map-gw",
            *("-t", "none", "-u", "none", "-T", "none", "-U", "none"),
            "-P",
            f"/proc/self/fd/{pid_fd}",
        ]
        if os.geteuid() == 0:
            # /dev/net/tun is often root-only: pasta keeps root but drops to the
            # capabilities it needs, in namespaces and a seccomp filter of its own.
            argv += ["--runas", "0:0"]
        if os.fstat(owner_fd).st_ino != Path("/proc/self/ns/user").stat().st_ino:
            argv += ["--userns", f"/proc/self/fd/{owner_fd}"]
        # Opened by us, passed as fds: pasta, having dropped most capabilities, could not
        # open /proc/<pid>/ns/* of a process with more of them than it has (ptrace access
        # rules). It cannot watch an fd path, so the exec stops it explicitly.
        argv += ["--netns", f"/proc/self/fd/{ns_fd}"]
        self_join = box.cgroup.self_join_files() if box.cgroup is not None else []
        shim = ["/bin/sh", "-c", SHIM, SHIM_NAME, "1", str(len(self_join)), *self_join]
        # Its messages go to a memfd: the daemon keeps the descriptor, so a pipe would
        # never reach EOF.
        err_fd = unshare.memfd("devs-sandbox-pasta-err", b"")
        fds.append(err_fd)
        proc = subprocess.Popen(
            [*shim, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err_fd,
            env=dict(PRIVILEGED_ENV),
            pass_fds=(ns_fd, owner_fd, pid_fd),
            close_fds=True,
            cwd="/",
        )
        assert proc.stdin is not None
        try:
            if box.cgroup is not None and not self_join:
                box.cgroup.add(proc.pid)
            proc.stdin.write(b"go\n")
            proc.stdin.close()
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            os.lseek(err_fd, 0, os.SEEK_SET)
            err = os.read(err_fd, 65536).decode(errors="replace")
            lines = [ln for ln in err.splitlines() if ln.strip() and "syslog" not in ln]
            raise DriverError(f"pasta failed: {lines[-1] if lines else proc.returncode}")
        os.lseek(pid_fd, 0, os.SEEK_SET)
        daemon = int(os.read(pid_fd, 64).decode().strip())
        return os.pidfd_open(daemon)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise DriverError(f"cannot connect the sandbox's network (pasta): {exc}") from exc
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def stop_pasta(pidfd: int) -> None:
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        ready, _, _ = select.select([pidfd], [], [], PASTA_STOP_GRACE_S)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)

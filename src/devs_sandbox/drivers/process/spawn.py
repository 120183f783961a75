"""How one exec starts: the argv after the shim (bwrap, our unshare launcher, or the
privilege drop alone), the environment the command gets, its rlimits, the fds it
inherits, and the adapters the shared exec loop reads and waits through.

Popen starts ``/bin/sh -c SHIM`` (as us, in a new session, with ``PATH`` only) and the
shim blocks on its stdin. Meanwhile the parent sets the shim's rlimits with prlimit(2)
(and on cgroup v2 moves it into the sandbox's cgroup), then says "go". The shim moves
itself into the v1 cgroups, then execs setpriv (drop to the sandbox uid, no_new_privs),
which execs bwrap (or the command); the command's environment crosses only after the
drop. Everything the command ever forks inherits the limits and the cgroup: no window
for a fork bomb to start outside them.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import resource
import select
import shlex
import subprocess
import termios
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from devs_sandbox.base import ExecRequest, OutputCallback
from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.linux import DEFAULT_PATH
from devs_sandbox.drivers.process.areas import secret_pipes
from devs_sandbox.drivers.process.state import Box
from devs_sandbox.errors import DriverError, IsolationUnavailableError
from devs_sandbox.isolation import (
    bwrap,
    drop_privileges_argv,
    is_sandbox_uid,
    layout,
    unshare,
)
from devs_sandbox.security.environment import EnvironmentSanitizer

# The shim and setpriv run as root in the host's namespaces: they get this environment
# only. The command's own (which a task's config may fill with LD_PRELOAD or
# LD_LIBRARY_PATH pointing into its workspace) is handed over after the privilege drop:
# to bwrap through --args on a memfd, or to a second shim that sources it from a memfd.
PRIVILEGED_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
ENV_SHIM: Final = '. "/dev/fd/$1" || exit 125; shift; exec "$@"'
ENV_SHIM_NAME: Final = "devs-sandbox-env"


@dataclass
class Launch:
    """The fds of one exec's launch: those the child inherits (closed in the parent once
    it runs) and those the parent keeps (handshakes with bwrap/nsinit), all closed at the
    end, whatever happens."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    child_fds: list[int] = field(default_factory=list)
    parent_fds: list[int] = field(default_factory=list)
    info_r: int | None = None
    block_w: int | None = None
    status_r: int | None = None
    started_probe: int | None = None  # our copy of bwrap's --block-fd read end
    pasta_pidfds: list[int] = field(default_factory=list)

    def child(self, fd: int) -> int:
        self.child_fds.append(fd)
        return fd

    def parent(self, fd: int) -> int:
        self.parent_fds.append(fd)
        return fd

    def never_started(self) -> bool:
        """After bwrap ended: whether it died before its last step before the command
        (reading the byte on ``--block-fd``, after every mount), so the command never ran
        and the run may be tried again. The byte still in the pipe says so; a task cannot
        forge it (it never holds the pipe's write end, and bwrap closes the read end)."""
        if self.started_probe is None:
            return False
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(self.started_probe, termios.FIONREAD, buf)
        except OSError:
            return False
        return buf[0] > 0

    def close_child_ends(self) -> None:
        """After the child started: our copies of its ends, so EOF on a handshake pipe
        means the other side is gone."""
        for fd in self.child_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.child_fds.clear()

    def close(self) -> None:
        self.close_child_ends()
        for fd in self.parent_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.parent_fds.clear()


class HeldOutput:
    """The caller's output callbacks, held back while bwrap has not yet reached the
    command: what arrives then is bwrap's own setup message, which a retried launch must
    not stream to the caller. Passed through, in order, from the first chunk after."""

    def __init__(
        self, launch: Launch, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
    ) -> None:
        self._launch = launch
        self._sinks = (on_stdout, on_stderr)
        self._held: list[tuple[int, bytes]] = []
        self._open = False  # until bwrap took its byte (or there is no bwrap)

    def request(self, request: ExecRequest) -> ExecRequest:
        if self._sinks == (None, None):
            return request
        out, err = self._sinks
        return dataclasses.replace(
            request,
            on_stdout=None if out is None else functools.partial(self._chunk, 0),
            on_stderr=None if err is None else functools.partial(self._chunk, 1),
        )

    def _chunk(self, which: int, data: bytes) -> None:
        if not self._open:
            if self._launch.never_started():
                self._held.append((which, data))
                return
            self.flush()
        sink = self._sinks[which]
        if sink is not None:
            sink(data)

    def flush(self) -> None:
        """Hand over what was held (the command ran, or this was the last try)."""
        self._open = True
        held, self._held = self._held, []
        for which, data in held:
            sink = self._sinks[which]
            if sink is not None:
                sink(data)


def sandbox_env(
    box: Box,
    sanitizer: EnvironmentSanitizer,
    host_env: Mapping[str, str],
    extra: Mapping[str, str] | None,
) -> dict[str, str]:
    """The sandbox's whole environment: harmless host variables that pass the sanitizer
    (locale, terminal, time zone), our fixed ones, the secrets' paths, then the caller's
    explicit variables. Nothing else of the host's."""
    if box.base_env is None:
        base = sanitizer.sanitize(host_env)
        base.setdefault("LANG", "C.UTF-8")
        base.setdefault("TERM", "dumb")
        base.update(
            {
                "PATH": DEFAULT_PATH,
                "HOME": str(box.workspace),
                "TMPDIR": "/tmp",
                "DEVS_SANDBOX_ID": box.id,
            }
        )
        for name, path in box.secret_paths.items():
            base[f"{name}_FILE"] = path
        base.update(box.config.env)
        box.base_env = base
    env = dict(box.base_env)
    if extra:
        env.update(extra)
    return env


def rlimits(box: Box) -> list[tuple[int, int]]:
    """The (resource, limit) pairs the parent sets on the shim before "go"."""
    q = box.config.quotas
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, q.max_open_files),
        (resource.RLIMIT_FSIZE, q.max_file_size_bytes),
    ]
    has_cgroup = box.cgroup is not None
    if q.address_space_bytes is not None:
        limits.append((resource.RLIMIT_AS, q.address_space_bytes))
    elif not has_cgroup:
        limits.append((resource.RLIMIT_AS, q.memory_bytes))
    if not has_cgroup:
        # Per uid, not per sandbox, and ignored for root: a last resort only. A uid the
        # sandbox shares (the caller's own, without root) already runs other processes,
        # which count too: the limit becomes an allowance on top of them, or even `true`
        # could not start under `--max-processes 5`.
        extra = 0 if is_sandbox_uid(box.uid) else tasks_of_uid(box.uid)
        limits.append((resource.RLIMIT_NPROC, q.process_count_limit + extra))
    return limits


def tasks_of_uid(uid: int) -> int:
    """The tasks (threads) whose real uid is ``uid``: what RLIMIT_NPROC counts."""
    count = 0
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                status = Path(entry.path, "status").read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            real = threads = -1
            for line in status.splitlines():
                if line.startswith(b"Uid:"):
                    real = int(line.split()[1])
                elif line.startswith(b"Threads:"):
                    threads = int(line.split()[1])
            if real == uid and threads > 0:
                count += threads
    return count


def drop_argv(box: Box) -> list[str]:
    """setpriv switching to the sandbox's uid, when it is not ours."""
    if box.uid == os.geteuid():
        return []
    argv = drop_privileges_argv(box.uid, box.gid)
    if not argv:
        raise IsolationUnavailableError(
            {"unprivileged-user": "setpriv (util-linux) not found; cannot drop privileges"}
        )
    return argv


def prepare_launch(
    box: Box,
    command: Sequence[str],
    full_env: dict[str, str],
    launch: Launch,
    cwd: Path,
) -> None:
    """The argv after the shim, its environment and the fds it inherits: bwrap or our
    unshare launcher with the sandbox's layout, seccomp program and (for pasta) the
    handshake pipes; without namespaces, the privilege drop and the filter only."""
    wants_seccomp = "seccomp" in box.isolation
    if box.launcher is None and not wants_seccomp:
        drop = drop_argv(box)
        if drop:
            lines = [f"export {k}={shlex.quote(v)}" for k, v in full_env.items()]
            lines.append("unset PWD")
            env_fd = launch.child(
                unshare.memfd("devs-sandbox-env", ("\n".join(lines) + "\n").encode())
            )
            launch.argv = [*drop, "/bin/sh", "-c", ENV_SHIM, ENV_SHIM_NAME, str(env_fd)]
            launch.argv += command
            launch.env = dict(PRIVILEGED_ENV)
        else:
            launch.argv, launch.env = list(command), full_env
        return
    seccomp_fd: int | None = None
    if wants_seccomp:
        from devs_sandbox.isolation import seccomp  # noqa: PLC0415 - imports libseccomp

        program = seccomp.build_bpf(seccomp.Profile(pid_namespace=box.launcher is not None))
        seccomp_fd = launch.child(unshare.memfd("devs-sandbox-seccomp", program))
    lay: layout.Layout | None = None
    if box.launcher is not None:
        secret_fds = (
            {}
            if box.secrets_placed
            else {n: launch.child(fd) for n, fd in secret_pipes(box).items()}
        )
        lay = layout.build(
            root=box.root,
            hide_paths=box.config.isolation.hide_paths,
            cgroup_dirs=box.cgroup.dirs if box.cgroup is not None else None,
            secret_fds=secret_fds,
            hide_state=box.uid == 0,
            chdir=cwd,
        )
    info_w = block_r = None
    if box.network == "pasta":
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        launch.info_r, launch.block_w = launch.parent(info_r), launch.parent(block_w)
        launch.child(info_w)
        launch.child(block_r)
    elif box.launcher == "bwrap":
        # bwrap reads one byte from --block-fd after its mounts, just before the command:
        # given at once here, it is only there to tell a failed setup from a failed
        # command afterwards (``Launch.never_started``).
        block_r, block_w = os.pipe()
        os.write(block_w, b"1")
        launch.parent(block_w)
        launch.child(block_r)
    if block_r is not None:
        launch.started_probe = launch.parent(os.dup(block_r))
    launch.env = dict(PRIVILEGED_ENV)
    if box.launcher == "bwrap":
        assert box.bwrap_path is not None and lay is not None
        args = ["--clearenv"]
        for k, v in full_env.items():
            args += ["--setenv", k, v]
        args_fd = launch.child(
            unshare.memfd("devs-sandbox-bwrap-args", b"\0".join(a.encode() for a in args))
        )
        launch.argv = [
            *drop_argv(box),
            *bwrap.render(
                box.bwrap_path,
                lay,
                command=command,
                network_namespace=box.network != "host",
                user_namespace=box.uid != 0,
                drop_caps=box.uid == 0,
                seccomp_fd=seccomp_fd,
                args_fd=args_fd,
                info_fd=info_w,
                block_fd=block_r,
            ),
        ]
        return
    # Our unshare launcher (or, without namespaces, its drop-and-filter mode): it drops
    # privileges itself, after the mounts that need them.
    status_r, status_w = os.pipe()
    launch.status_r = launch.parent(status_r)
    launch.child(status_w)
    env_fd = launch.child(unshare.memfd("devs-sandbox-env", unshare.env_blob(full_env)))
    spec = unshare.spec(
        lay,
        userns=os.geteuid() != 0,
        uid=box.uid,
        gid=box.gid,
        env_fd=env_fd,
        seccomp_fd=seccomp_fd,
        status_fd=status_w,
        network_namespace=box.network != "host",
        info_fd=info_w,
        block_fd=block_r,
    )
    spec_fd = launch.child(unshare.memfd("devs-sandbox-nsinit", json.dumps(spec).encode()))
    launch.argv = unshare.argv(spec_fd, command)


class Pipe:
    """One of the exec's pipes as the shared loop sees it (an output source or stdin)."""

    def __init__(self, stream: IO[bytes], tag: int) -> None:
        self.fd = stream.fileno()
        self.stream = stream
        self.tag = tag
        os.set_blocking(self.fd, False)

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[tuple[int, bytes]] | None:
        data = os.read(self.fd, exec_io.READ_CHUNK)
        return None if not data else [(self.tag, data)]

    def finish(self) -> list[tuple[int, bytes]]:
        return []

    def write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def close(self) -> None:
        self.stream.close()


class Child:
    """The exec's leader: a pidfd for its exit (Linux 5.3+; polled otherwise), wait4 for
    its status and rusage, and the kill that reaches its whole tree."""

    def __init__(self, proc: subprocess.Popen[bytes], kill: Callable[[], None]) -> None:
        self.proc = proc
        self._kill = kill
        self.status: int | None = None
        self.rusage: resource.struct_rusage | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def exit_fd(self) -> int | None:
        return self.pidfd

    def poll(self) -> bool:
        return self.reap(block=False)

    def reap(self, *, block: bool) -> bool:
        if self.status is not None:
            return True
        try:
            pid, status, rusage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            self.status = 0
            return True
        if pid == 0:
            return False
        self.status, self.rusage = status, rusage
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return True

    def kill(self) -> None:
        self._kill()

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def read_child_pid(fd: int, deadline: float, proc: subprocess.Popen[bytes]) -> int:
    """The sandbox's pid from the launcher's info fd (bwrap's JSON, or nsinit's)."""
    data = b""
    while True:
        try:
            info = json.loads(data)
            return int(info["child-pid"])
        except (ValueError, KeyError, TypeError):
            pass
        chunk = read_some(fd, deadline)
        if not chunk:
            raise DriverError(
                f"the sandbox launcher exited before its network was set up (exit {proc.poll()})"
            )
        data += chunk


def read_some(fd: int, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DriverError("the sandbox launcher did not answer in time")
    ready, _, _ = select.select([fd], [], [], remaining)
    if not ready:
        raise DriverError("the sandbox launcher did not answer in time")
    return os.read(fd, 4096)


def read_until_eof(fd: int, deadline: float) -> bytes:
    """nsinit's status fd: EOF alone (closed by the command's exec) means it started."""
    data = b""
    while chunk := read_some(fd, deadline):
        data += chunk
    return data

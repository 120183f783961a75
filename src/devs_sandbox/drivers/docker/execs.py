"""Running a command in a container sandbox: through the launcher (the first exec that
needs no stdin) or a ``docker exec`` of the shared shim, each moved into a cgroup of its
own before it runs, then fed to the shared exec loop (``drivers/exec_io``). A per-call
timeout freezes and SIGKILLs that cgroup: the exec's whole tree and nothing else."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Final

from devs_sandbox.base import ExecRequest
from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.docker.hardening import INFRA_PROCESSES
from devs_sandbox.drivers.docker.launcher import (
    CD_SHIM,
    AttachStream,
    Trailer,
    launcher_request,
    raw_socket,
    sh_quote,
)
from devs_sandbox.drivers.docker.state import (
    EXEC_START_TIMEOUT_S,
    WORKSPACE,
    Box,
    Exec,
    pidfd,
    wait_child,
)
from devs_sandbox.drivers.linux import SHIM, SHIM_NAME, signal_from_code
from devs_sandbox.engine import engine_errors
from devs_sandbox.errors import (
    DevsSandboxError,
    DriverError,
    DriverUnavailableError,
    SandboxNotFoundError,
)
from devs_sandbox.isolation.cgroups import SandboxCgroup
from devs_sandbox.models import ENV_NAME, ExecResult, ResourceUsage

if TYPE_CHECKING:
    from devs_sandbox.drivers.docker.driver import DockerDriver

logger = logging.getLogger(__name__)

LAUNCHER_TRAILER_WAIT_S: Final = 5.0  # after the task exits the launcher writes at once
EXIT_STATUS_WAIT_S: Final = 5.0  # until exec_inspect reports an exited exec's status
ENGINE_POLL_S: Final = 0.05  # exit polling through exec_inspect (an API round trip) without pidfds
SECRETS_DIR: Final = "/tmp/.devs-secrets"  # in the container's private /tmp tmpfs
# Writes stdin to $SECRETS_DIR/$1, 0400, in a 0500 directory (made writable for the
# moment of the write only).
SECRET_WRITER: Final = (
    f'd={SECRETS_DIR}; mkdir -p "$d" && chmod 0700 "$d" && '
    '(umask 0277 && cat > "$d/$1") && chmod 0500 "$d"'
)


class Execs:
    """The exec side of one ``DockerDriver``."""

    def __init__(self, driver: DockerDriver) -> None:
        self.d = driver

    def secrets_prelude(self, box: Box) -> str | None:
        """Shell that writes the secrets, for the launcher's one request: the values travel
        in the request on the launcher's stdin (never argv, never the container's env),
        and printf is a builtin. None when a value cannot live in a shell string (NUL)."""
        if any(b"\0" in v for v in box.secrets.values()):
            return None
        writes = [
            f"(umask 0277 && printf %s {sh_quote(bytes(v).decode('utf-8', 'surrogateescape'))}"
            f' > "$d/{name}")'
            for name, v in box.secrets.items()
        ]
        return (
            f'd={SECRETS_DIR}; mkdir -p "$d" && chmod 0700 "$d" && '
            + " && ".join(writes)
            + ' && chmod 0500 "$d" || exit 125'
        )

    def write_secrets(self, box: Box) -> None:
        """Without the launcher: one exec per secret, the value on the exec's stdin."""
        for name, value in box.secrets.items():
            result = self.run(
                box,
                ExecRequest(
                    ("/bin/sh", "-c", SECRET_WRITER, "devs-sandbox-secret", name),
                    stdin=bytes(value),
                ),
                launcher=False,
            )
            if result.exit_code != 0:
                raise DriverError(
                    f"cannot deliver secret {name} into the container (exit {result.exit_code}): "
                    f"{result.stderr.text.strip()[-200:]}"
                )

    def run(
        self,
        box: Box,
        request: ExecRequest,
        *,
        stdin_file: IO[bytes] | None = None,
        launcher: bool = True,
    ) -> ExecResult:
        command, stdin = request.argv, request.stdin
        max_output_bytes = request.max_output_bytes
        if request.cwd is not None:
            # A directory of the workspace: the shell changes into it, then becomes the command.
            command = ("/bin/sh", "-c", CD_SHIM, f"{WORKSPACE}/{request.cwd}", *command)
        cap = box.config.max_output_bytes if max_output_bytes is None else max_output_bytes
        extra = dict(request.env)
        sock: socket.socket | None = None
        through_launcher = (
            launcher
            and stdin is None
            and stdin_file is None
            and box.launcher_pid is not None
            and all(ENV_NAME.fullmatch(k) for k in extra)
        )
        prelude: str | None = None
        if box.secrets_pending and launcher:  # a user's exec: the secrets must be there first
            box.secrets_pending = False
            prelude = self.secrets_prelude(box) if through_launcher else None
            if prelude is None:
                self.write_secrets(box)
        if through_launcher:
            with box.lock:
                sock, box.launcher_sock = box.launcher_sock, None
        if box.cgroup is not None and "memory" in box.cgroup.dirs:
            # Per-exec peak: v1 lets us reset the high-water mark.
            with contextlib.suppress(OSError):
                (box.cgroup.dirs["memory"] / "memory.max_usage_in_bytes").write_text("0")
        cpu_before = self.d.counters(box).cpu_time_s
        start = time.monotonic()
        if sock is not None:
            ex = self.start_launcher(box, sock, command, extra, prelude)
        else:
            ex = self.start_exec(box, command, extra, stdin is not None or stdin_file is not None)
        try:
            if request.on_start is not None:
                try:
                    request.on_start(ex.pid)
                except Exception:
                    logger.exception("on_start callback failed")
            return self.pump(
                box, ex, request, start=start, stdin_file=stdin_file, cap=cap, cpu_before=cpu_before
            )
        finally:
            with contextlib.suppress(OSError):
                ex.sock.close()
            if ex.pidfd is not None:
                os.close(ex.pidfd)
            if ex.cgroup is not None and not ex.cgroup.pids() and not ex.cgroup.remove():
                with box.lock:
                    box.exec_cgroups.remove(ex.cgroup)

    def confine(self, box: Box, pid: int) -> SandboxCgroup | None:
        """Move the (waiting) exec leader into a cgroup of its own inside the container's."""
        if box.exec_parent is None:
            return None
        seq = next(box.exec_seq)
        dirs = {k: v / f"devs-exec-{seq}" for k, v in box.exec_parent.items()}
        cg = SandboxCgroup(self.d.cgroups, box.id, dirs=dirs)
        try:
            cg.make_dirs()
            cg.add(pid)
        except OSError as exc:
            logger.warning("sandbox %s: no cgroup for exec %d (%s)", box.id, seq, exc)
            cg.remove()
            return None
        with box.lock:
            box.exec_cgroups.append(cg)
        return cg

    def start_launcher(
        self,
        box: Box,
        sock: socket.socket,
        command: Sequence[str],
        env: Mapping[str, str],
        prelude: str | None = None,
    ) -> Exec:
        nonce = secrets.token_hex(8)
        try:
            sock.sendall(launcher_request(nonce, command, env, prelude))
        except OSError as exc:
            with contextlib.suppress(OSError):
                sock.close()
            raise self.lost(box, f"cannot reach the launcher: {exc}") from exc
        assert box.launcher_pid is not None
        pid = wait_child(box.launcher_pid, EXEC_START_TIMEOUT_S)
        if pid is None:
            with contextlib.suppress(OSError):
                sock.close()
            raise self.lost(box, "the launcher did not start the command")
        ex = Exec(sock, pid, None, nonce, self.confine(box, pid), pidfd(pid))
        try:
            sock.sendall(b"go\n")
        except OSError as exc:
            with contextlib.suppress(OSError):
                sock.close()
            raise self.lost(box, f"cannot reach the launcher: {exc}") from exc
        return ex

    def start_exec(
        self, box: Box, command: Sequence[str], env: Mapping[str, str], with_stdin: bool
    ) -> Exec:
        # The process driver's shim, with no cgroup to join itself (the exec is confined
        # from outside, into a child of the container's cgroup).
        argv = ["/bin/sh", "-c", SHIM, SHIM_NAME, "1" if with_stdin else "0", "0", *command]

        def missing() -> DevsSandboxError:
            return SandboxNotFoundError(box.id)

        try:
            with engine_errors(f"exec in {box.name}", not_found=missing):
                exec_id, keep = self.create_exec(box, argv, env)
        except DriverError as exc:
            if isinstance(exc, DriverUnavailableError):
                raise
            raise self.lost(box, str(exc)) from exc
        sock = raw_socket(keep)
        try:
            pid = self.exec_pid(exec_id)
            ex = Exec(sock, pid, exec_id, None, self.confine(box, pid), pidfd(pid), keep)
            sock.sendall(b"go\n")
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return ex

    def create_exec(self, box: Box, argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, Any]:
        api = self.d.client.api
        exec_id = str(
            api.exec_create(
                box.container_id,
                argv,
                stdin=True,
                stdout=True,
                stderr=True,
                environment=[f"{k}={v}" for k, v in env.items()] or None,
                workdir=WORKSPACE,
            )["Id"]
        )
        # The shim waits for "go": nothing can reach the stream before we read the raw socket
        # (bytes sent with the HTTP upgrade response would sit in the SDK's buffer).
        return exec_id, api.exec_start(exec_id, socket=True)

    def exec_pid(self, exec_id: str) -> int:
        api = self.d.client.api
        end = time.monotonic() + EXEC_START_TIMEOUT_S
        delay = 0.0005
        while True:
            with engine_errors("inspect exec"):
                info = api.exec_inspect(exec_id)
            pid = int(info.get("Pid") or 0)
            if pid > 0:
                return pid
            if info.get("ExitCode") is not None and not info.get("Running"):
                raise DriverError(f"exec ended before it started (exit {info.get('ExitCode')})")
            if time.monotonic() >= end:
                raise DriverError(
                    f"the engine did not start the exec within {EXEC_START_TIMEOUT_S} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def lost(self, box: Box, why: str) -> DevsSandboxError:
        if not self.d.alive(box):
            return SandboxNotFoundError(box.id)
        return DriverError(f"sandbox {box.id}: {why}")

    def kill_exec(self, box: Box, ex: Exec) -> None:
        if ex.cgroup is not None and ex.cgroup.kill_all():
            return
        # No cgroup of its own: only the whole container is certain to reach every process.
        logger.warning("sandbox %s: killing the whole container to stop an exec", box.id)
        self.d.stop_box(box)

    def pump(
        self,
        box: Box,
        ex: Exec,
        request: ExecRequest,
        *,
        start: float,
        stdin_file: IO[bytes] | None,
        cap: int,
        cpu_before: float | None,
    ) -> ExecResult:
        ex.sock.setblocking(False)
        stream = AttachStream(ex.sock, ex.nonce)
        feeding = request.stdin is not None or stdin_file is not None
        io = exec_io.ExecIO(
            sources=[stream],
            process=RunningExec(self, box, ex, stream),
            stdin=stream if feeding else None,
            stdin_data=request.stdin if request.stdin is not None else (b"" if feeding else None),
            stdin_file=stdin_file,
            sample=lambda: self.sample_processes(box),
            # After the task exits the launcher writes its trailers at once; a plain exec's
            # stream may be held by a grandchild, as a pipe would be.
            exit_grace_s=LAUNCHER_TRAILER_WAIT_S if ex.nonce else exec_io.EXIT_DRAIN_GRACE_S,
            exit_poll_s=ENGINE_POLL_S,
        )
        outcome = exec_io.run(
            io,
            timeout_s=request.timeout_s,
            idle_timeout_s=request.idle_timeout_s,
            max_output_bytes=cap,
            redactor=box.redactor,
            on_stdout=request.on_stdout,
            on_stderr=request.on_stderr,
            start=start,
        )
        code = self.exit_status(box, ex, stream.trailers)
        if code is None:  # the container or the launcher died under the command
            code = 128 + signal.SIGKILL
        self.sample_processes(box)
        return ExecResult(
            exit_code=code,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            duration_s=outcome.duration_s,
            timed_out=outcome.timed_out,
            idle_timed_out=outcome.idle_timed_out,
            signal=signal_from_code(code),
            resources=self.usage(box, outcome.duration_s, cpu_before),
        )

    def exec_running(self, exec_id: str | None) -> bool:
        if exec_id is None:
            return False
        try:
            with engine_errors("inspect exec"):
                return bool(self.d.client.api.exec_inspect(exec_id).get("Running"))
        except DevsSandboxError:
            return False

    def exit_status(self, box: Box, ex: Exec, trailers: Mapping[int, Trailer] | None) -> int | None:
        if trailers is not None:
            for t in trailers.values():
                if t.status is not None:
                    return t.status
            return None
        assert ex.exec_id is not None
        end = time.monotonic() + EXIT_STATUS_WAIT_S
        while True:
            try:
                with engine_errors("inspect exec"):
                    info = self.d.client.api.exec_inspect(ex.exec_id)
            except DevsSandboxError:
                return None  # the container is gone (removed after an OOM kill, say)
            code = info.get("ExitCode")
            if not info.get("Running") and code is not None:
                return int(code)
            if time.monotonic() >= end or not self.d.alive(box):
                return None
            time.sleep(0.01)

    def sample_processes(self, box: Box) -> None:
        if box.cgroup is None:
            return
        n = box.cgroup.pids_current()
        if n is not None:
            box.peak_processes = max(box.peak_processes, n - INFRA_PROCESSES)

    def usage(self, box: Box, wall_s: float, cpu_before: float | None) -> ResourceUsage:
        cpu: float | None = None
        peak_mem: int | None = None
        if box.cgroup is not None:
            c = self.d.counters(box)
            if c.cpu_time_s is not None and cpu_before is not None:
                cpu = max(0.0, c.cpu_time_s - cpu_before)
            peak_mem = c.peak_memory_bytes
            # Not pids.peak: it also counts the engine's own start-up processes (runc init).
        return ResourceUsage(
            cpu_time_s=cpu,
            peak_memory_bytes=peak_mem,
            peak_processes=max(box.peak_processes, 1),
            wall_time_s=wall_s,
        )


class RunningExec:
    """The exec as the shared loop sees it: exited when its leader's pidfd fires, the
    launcher's trailers arrive, or the engine says so; killed through its own cgroup."""

    def __init__(self, execs: Execs, box: Box, ex: Exec, stream: AttachStream) -> None:
        self.execs, self.box, self.ex, self.stream = execs, box, ex, stream
        self.exited = False

    def exit_fd(self) -> int | None:
        return self.ex.pidfd

    def poll(self) -> bool:
        if self.exited:
            return True
        if self.stream.trailers is not None and self.stream.done:
            self.exited = True
        elif self.ex.pidfd is not None:
            self.exited = bool(select.select([self.ex.pidfd], [], [], 0)[0])
        elif self.ex.exec_id is not None:
            self.exited = not self.execs.exec_running(self.ex.exec_id)
        elif self.stream.eof:
            self.exited = True
        return self.exited

    def kill(self) -> None:
        self.execs.kill_exec(self.box, self.ex)

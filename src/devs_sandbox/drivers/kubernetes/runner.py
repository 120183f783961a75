"""Running one exec in a sandbox pod through the shared exec loop (``exec_io.run``).

A command goes through the shim (``shim.SHIM``: limits, environment, secrets, supervisor)
with its header on the exec's stdin; the driver's own scripts (probe, sample, kill, force
stop) run as plain ``sh -c`` execs. Either way the WebSocket (``transport.ExecChannel``) is
the loop's output source and stdin sink, the exit is seen when channel 3 speaks or the
stream ends, and a kill (an exec's timeout) is a second exec that signals the first one's
supervisor: the loop keeps draining output meanwhile, for at most ``KILL_GRACE_S``.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Final

from devs_sandbox.base import ExecRequest
from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.kubernetes import shim
from devs_sandbox.drivers.kubernetes.box import Box
from devs_sandbox.drivers.kubernetes.client import Cluster
from devs_sandbox.drivers.kubernetes.manifest import CONTAINER
from devs_sandbox.drivers.kubernetes.transport import (
    ExecChannel,
    ExecStatus,
    HandshakeError,
    exec_url,
)

logger = logging.getLogger(__name__)

KILL_GRACE_S: Final = 10.0  # a kill is an exec round trip plus the supervisor's sweep
EXIT_GRACE_S: Final = 0.05  # after channel 3, only the close frame is still to come
EXIT_POLL_S: Final = 0.02  # the channel's status is a flag: polling it costs nothing
SCRIPT_OUTPUT_BYTES: Final = 1 << 20  # what the driver's own scripts may print


@dataclass
class Outcome:
    """One exec, as the loop and channel 3 left it."""

    io: exec_io.IOResult
    status: ExecStatus
    nonce: str
    killed_all: bool = False  # the kill had to take every task process (no supervisor)


class _Process:
    """exec_io.ExecProcess over a channel: exited once channel 3 spoke or the stream ended;
    killed by ``on_kill`` on a thread of its own (an exec round trip)."""

    def __init__(self, channel: ExecChannel, on_kill: Callable[[], None] | None) -> None:
        self.channel = channel
        self.on_kill = on_kill
        self._kill_started = False

    def exit_fd(self) -> int | None:
        return None

    def poll(self) -> bool:
        self.channel.flush()  # stdin the socket could not take before
        return self.channel.status_seen or self.channel.eof

    def kill(self) -> None:
        if self._kill_started:
            return
        self._kill_started = True
        if self.on_kill is None:
            self.channel.shutdown()  # one of our own scripts: leaving is enough
            return
        threading.Thread(target=self.on_kill, name="devs-k8s-kill", daemon=True).start()


class ExecRunner:
    """Opens execs in one cluster's pods."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _open(self, pod: str, argv: Sequence[str]) -> ExecChannel:
        url = exec_url(self.cluster.host, self.cluster.namespace, pod, CONTAINER, argv)
        return ExecChannel.connect(self.cluster.configuration, url, self.cluster.timeout_s)

    def script(
        self, pod: str, script: str, args: Sequence[str] = (), *, timeout_s: float
    ) -> tuple[str, str, ExecStatus]:
        """One of the driver's own scripts: (stdout, stderr, status)."""
        channel = self._open(pod, ["/bin/sh", "-c", script, "devs-sandbox", *args])
        try:
            channel.close()  # no stdin
            result = exec_io.run(
                exec_io.ExecIO(
                    sources=[channel],
                    process=_Process(channel, None),
                    exit_grace_s=EXIT_GRACE_S,
                    kill_grace_s=0.0,
                    exit_poll_s=EXIT_POLL_S,
                ),
                timeout_s=timeout_s,
                idle_timeout_s=None,
                max_output_bytes=SCRIPT_OUTPUT_BYTES,
            )
            status = channel.status
        finally:
            channel.shutdown()
        return result.stdout.text, result.stderr.text, status

    def command(
        self,
        box: Box,
        request: ExecRequest,
        *,
        cap: int,
        header_secrets: Mapping[str, bytes | bytearray] | None = None,
        stdin_file: IO[bytes] | None = None,
    ) -> Outcome:
        """A command through the shim and supervisor (see the module docstring)."""
        assert box.probe is not None
        nonce = f"{box.uid}-{next(box.exec_seq)}-{secrets.token_hex(6)}"
        feeding = request.stdin is not None or stdin_file is not None
        channel = self._open(box.name, ["/bin/sh", "-c", shim.SHIM, shim.SHIM_NAME])
        killed_all: list[bool] = []

        def kill() -> None:
            try:
                _, _, status = self.script(box.name, shim.KILL, [nonce], timeout_s=KILL_GRACE_S)
            except Exception:
                logger.exception("sandbox %s: the exec kill failed", box.id)
                return
            if status.code == 3:
                killed_all.append(True)
                logger.warning("sandbox %s: no supervisor found: killed every task process", box.id)

        try:
            length: int | None = None
            if feeding and not channel.can_close_stdin:
                if stdin_file is not None:
                    raise HandshakeError(
                        "the API server has no v5.channel.k8s.io: an exec cannot stream a "
                        "file to stdin (copyIn needs Kubernetes 1.30+)",
                        None,
                    )
                length = len(request.stdin or b"")
            header = shim.exec_header(
                nonce=nonce,
                argv=request.argv,
                env=request.env,
                limits=box.plan.limits,
                nproc_flag=box.probe.nproc_flag,
                supervisor=box.probe.supervisor,
                cwd=request.cwd,
                stdin=feeding,
                stdin_length=length,
                secrets=header_secrets,
            )
            channel.send_stdin(header)
            if not feeding:
                channel.close()
            result = exec_io.run(
                exec_io.ExecIO(
                    sources=[channel],
                    process=_Process(channel, kill),
                    stdin=channel if feeding else None,
                    stdin_data=request.stdin
                    if request.stdin is not None
                    else (b"" if feeding else None),
                    stdin_file=stdin_file,
                    exit_grace_s=EXIT_GRACE_S,
                    kill_grace_s=KILL_GRACE_S,
                    exit_poll_s=EXIT_POLL_S,
                ),
                timeout_s=request.timeout_s,
                idle_timeout_s=request.idle_timeout_s,
                max_output_bytes=cap,
                redactor=box.redactor,
                on_stdout=request.on_stdout,
                on_stderr=request.on_stderr,
            )
            status = channel.status
        finally:
            channel.shutdown()
        return Outcome(result, status, nonce, bool(killed_all))

    def kill_exec(self, box: Box, nonce: str) -> None:
        """Kill one exec's tree through its supervisor; without one (no python3 in the
        image), every task process of the sandbox (pid 1 spared)."""
        if box.probe is not None and box.probe.supervisor:
            self.script(box.name, shim.KILL, [nonce], timeout_s=KILL_GRACE_S)
        else:
            self.script(box.name, shim.FORCE_STOP, timeout_s=KILL_GRACE_S)

"""What one invocation of the command sees of the world: its streams, environment and
working directory.

In a process of its own, that is ``sys.std*``, ``os.environ`` and the current directory.
Through the local server (``cli/server.py``) it is the client's: the streams are the
client's own descriptors (passed over the socket), the environment and directory are
the client's. Every command reads the world through a ``Console``, never ``os.environ``
or ``sys.stdout`` directly, so both paths behave the same.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Final, TextIO

PROG: Final = "devs-sandbox"
EXIT_TIMEOUT: Final = 124
EXIT_CANNOT_RUN: Final = 125
EXIT_KILLED: Final = 137
EXIT_INTERRUPTED: Final = 130
EXIT_USAGE: Final = 2
EXIT_ERROR: Final = 1


class UsageError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RunInCaller(Exception):  # noqa: N818 - a request to move, not an error
    """Raised by a command that the local server must not run for its client (before it
    touched anything: no output, no stdin read, no sandbox): the client runs it in its own
    process instead. A run whose configuration picks the ray driver is one: Ray's client
    connection belongs to the calling process, one per process, not to a server shared by
    every client of this user."""


@dataclass
class Console:
    """Text streams ``out``/``err`` (with ``.buffer`` for bytes), binary ``stdin``, the
    environment and the working directory; ``on_cancel`` receives the hook that cancels the
    running sandbox (the server calls it when its client is interrupted)."""

    out: TextIO
    err: TextIO
    stdin: IO[bytes] | BinaryIO
    env: Mapping[str, str]
    cwd: Path
    in_process: bool = True
    cancel_hooks: list[Callable[[], object]] = field(default_factory=list)

    @classmethod
    def current(cls) -> Console:
        return cls(sys.stdout, sys.stderr, sys.stdin.buffer, os.environ, Path.cwd())

    @classmethod
    def from_fds(
        cls, stdin: int, stdout: int, stderr: int, env: Mapping[str, str], cwd: Path
    ) -> Console:
        """A client's streams by descriptor (the server's side): line-buffered text over
        unbuffered bytes, so streamed output reaches the client as it comes."""

        def text(fd: int) -> TextIO:
            raw = io.FileIO(fd, "wb", closefd=True)
            return io.TextIOWrapper(
                io.BufferedWriter(raw),
                encoding="utf-8",
                errors="replace",
                line_buffering=True,
                write_through=True,
            )

        return cls(
            text(stdout),
            text(stderr),
            os.fdopen(stdin, "rb", buffering=0, closefd=True),
            dict(env),
            cwd,
            in_process=False,
        )

    def path(self, value: str | Path) -> Path:
        """A path the user typed, relative to *their* working directory."""
        p = Path(value)
        return p if p.is_absolute() else self.cwd / p

    def on_cancel(self, hook: Callable[[], object]) -> None:
        self.cancel_hooks.append(hook)

    def close(self) -> None:
        for stream in (self.out, self.err, self.stdin):
            with contextlib.suppress(OSError):
                stream.close()

"""A command's output as an agent gets it: capped per call, sent once, never mangled.

The run tools tap the exec (``tools.shell.OutputTap``): each stream's redacted bytes go
into a ``HeadTailCapture`` of the call's ``max_output_bytes`` (head and tail, as the
library keeps them), and the running totals and the latest line of output feed the
progress notifications (how a host shows a long command is alive; MCP's log
notifications, which some servers stream output through, are deprecated as of
2026-07-28). At the end the kept bytes are rendered once, into the one JSON text block of
the result:

- ``encoding="text"``: UTF-8, with the library's marker where the middle was dropped;
  bytes that are not UTF-8 become U+FFFD and the stream says ``*_binary: true``, so an
  agent knows to ask again with ``output_encoding="base64"`` rather than trust them;
- ``encoding="base64"``: the kept bytes exactly; when the middle was dropped, the first
  ``max_output_bytes // 2`` decoded bytes are the head and the rest the tail.

A cut between head and tail can split a multi-byte character: that alone is not binary.
"""

from __future__ import annotations

import base64
import codecs
import itertools
import re
from typing import Any, Final

from devs_sandbox.capture import TRUNCATION_MARKER, HeadTailCapture
from devs_sandbox.tools.shell import OutputTap

ENCODINGS: Final = ("text", "base64")
_UTF8_CONTINUATION: Final = range(0x80, 0xC0)
# The latest line a progress message quotes: at most this many characters of it, from a
# partial line of at most LINE_BYTES bytes kept while it is written.
LINE_CHARS: Final = 160
LINE_BYTES: Final = 4096


# Terminal escape sequences: CSI (colours, cursor moves) and OSC (titles, links).
_ESCAPES: Final = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")


def _printable(line: bytes) -> str:
    """A line as a status message may show it: UTF-8 (else U+FFFD), what a terminal
    would show after the last carriage return (a progress bar's latest state), escape
    sequences removed and any other control character a space, trimmed and cut to
    ``LINE_CHARS``."""
    text = line.decode("utf-8", errors="replace").rstrip("\r").rpartition("\r")[2]
    text = _ESCAPES.sub("", text)
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= LINE_CHARS else text[: LINE_CHARS - 1] + "…"


def _is_text(head: bytes, tail: bytes, *, cut: bool) -> bool:
    """Whether the kept bytes are UTF-8 text without NULs, allowing a character split by
    the cut (at the end of the head, at the start of the tail)."""
    if b"\0" in head or b"\0" in tail:
        return False
    if not cut:
        head, tail = head + tail, b""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(head, final=not cut)
        if cut:
            skip = 0
            while skip < min(3, len(tail)) and tail[skip] in _UTF8_CONTINUATION:
                skip += 1
            codecs.decode(tail[skip:], "utf-8", "strict")
    except UnicodeDecodeError:
        return False
    return True


class StreamCopy:
    """One stream's kept bytes, its total and its latest non-blank line, fed from the
    exec's thread (the progress reports read ``last_line`` from another: one reference,
    replaced whole)."""

    def __init__(self, max_bytes: int, order: itertools.count[int]) -> None:
        self._capture = HeadTailCapture(max_bytes)
        self._order = order  # shared by both streams of a call
        self._partial = b""
        self.last_line: tuple[int, str] | None = None  # (order of arrival, the line)

    def feed(self, chunk: bytes) -> None:
        self._capture.feed(chunk)
        data = self._partial + chunk
        end = data.rfind(b"\n")
        self._partial = data[end + 1 :][-LINE_BYTES:]
        while end >= 0:  # back over the complete lines, to the last one not blank
            start = data.rfind(b"\n", 0, end) + 1
            shown = _printable(data[max(start, end - LINE_BYTES) : end])
            if shown:
                self.last_line = (next(self._order), shown)
                return
            end = start - 1

    @property
    def total_bytes(self) -> int:
        return self._capture.total_bytes

    def render(self, name: str, encoding: str) -> dict[str, Any]:
        head, tail = self._capture.kept()
        dropped = self._capture.dropped_bytes
        binary = not _is_text(head, tail, cut=dropped > 0)
        if encoding == "base64":
            data = base64.b64encode(head + tail).decode("ascii")
        else:
            data = head.decode("utf-8", errors="replace")
            if dropped:
                data += TRUNCATION_MARKER.format(dropped=dropped)
            data += tail.decode("utf-8", errors="replace")
        return {
            name: data,
            f"{name}_truncated": dropped > 0,
            f"{name}_bytes": self.total_bytes,
            f"{name}_binary": binary,
        }


class CallOutput:
    """Both streams of one call, and the tap that fills them."""

    def __init__(self, max_output_bytes: int, encoding: str = "text") -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}")
        self.max_output_bytes = max_output_bytes
        self.encoding = encoding
        order = itertools.count(1)  # which stream wrote its latest line last
        self.stdout = StreamCopy(max_output_bytes, order)
        self.stderr = StreamCopy(max_output_bytes, order)

    def tap(self) -> OutputTap:
        return OutputTap(
            max_output_bytes=self.max_output_bytes,
            on_stdout=self.stdout.feed,
            on_stderr=self.stderr.feed,
        )

    def progress_message(self, elapsed_s: float) -> str:
        message = (
            f"running for {elapsed_s:.0f} s; {self.stdout.total_bytes} bytes of stdout and "
            f"{self.stderr.total_bytes} of stderr so far"
        )
        lines = [
            (line[0], name, line[1])
            for name, line in (("stdout", self.stdout.last_line), ("stderr", self.stderr.last_line))
            if line is not None
        ]
        if lines:
            _, name, text = max(lines)
            message += f"; last line ({name}): {text}"
        return message

    def fields(self) -> dict[str, Any]:
        """The output part of a run tool's answer (success or error)."""
        return {
            **self.stdout.render("stdout", self.encoding),
            **self.stderr.render("stderr", self.encoding),
            "encoding": self.encoding,
        }

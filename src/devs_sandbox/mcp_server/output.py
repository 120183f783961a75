"""A command's output as an agent gets it: capped per call, sent once, never mangled.

The run tools tap the exec (``tools.shell.OutputTap``): each stream's redacted bytes go
into a ``HeadTailCapture`` of the call's ``max_output_bytes`` (head and tail, as the
library keeps them), and the running totals feed the progress notifications. At the end
the kept bytes are rendered once, into the one JSON text block of the result:

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
from typing import Any, Final

from devs_sandbox.capture import TRUNCATION_MARKER, HeadTailCapture
from devs_sandbox.tools.shell import OutputTap

ENCODINGS: Final = ("text", "base64")
_UTF8_CONTINUATION: Final = range(0x80, 0xC0)


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
    """One stream's kept bytes and its total, fed from the exec's thread."""

    def __init__(self, max_bytes: int) -> None:
        self._capture = HeadTailCapture(max_bytes)

    def feed(self, chunk: bytes) -> None:
        self._capture.feed(chunk)

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
        self.stdout = StreamCopy(max_output_bytes)
        self.stderr = StreamCopy(max_output_bytes)

    def tap(self) -> OutputTap:
        return OutputTap(
            max_output_bytes=self.max_output_bytes,
            on_stdout=self.stdout.feed,
            on_stderr=self.stderr.feed,
        )

    def progress_message(self, elapsed_s: float) -> str:
        return (
            f"running for {elapsed_s:.0f} s; {self.stdout.total_bytes} bytes of stdout and "
            f"{self.stderr.total_bytes} of stderr so far"
        )

    def fields(self) -> dict[str, Any]:
        """The output part of a run tool's answer (success or error)."""
        return {
            **self.stdout.render("stdout", self.encoding),
            **self.stderr.render("stderr", self.encoding),
            "encoding": self.encoding,
        }

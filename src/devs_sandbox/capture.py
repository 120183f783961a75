"""Bounded output capture: keep the head and the tail, count the middle, hold nothing more.

An output flood must not grow the caller's memory, and an agent reading a
failed build needs its last lines more than its first. So each stream keeps at
most ``cap`` bytes: the first half as it arrives, and a sliding window of the
last half. What falls out of the window is counted, never stored.
"""

from __future__ import annotations

from collections.abc import Callable

from devs_sandbox.models import CapturedStream

TRUNCATION_MARKER = "\n[... devs-sandbox: {dropped} bytes dropped ...]\n"


class HeadTailCapture:
    """Accumulates one stream in O(cap) memory whatever its length."""

    __slots__ = ("_head", "_head_cap", "_tail", "_tail_cap", "total_bytes")

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError("cap_bytes must be >= 0")
        self._head_cap = cap_bytes // 2
        self._tail_cap = cap_bytes - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total_bytes = 0

    def feed(self, chunk: bytes) -> None:
        self.total_bytes += len(chunk)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        if len(chunk) >= self._tail_cap:
            self._tail = bytearray(chunk[len(chunk) - self._tail_cap :])
            return
        self._tail += chunk
        excess = len(self._tail) - self._tail_cap
        if excess > 0:
            # CPython bytearrays drop a prefix by moving a start offset: amortised O(1).
            del self._tail[:excess]

    @property
    def dropped_bytes(self) -> int:
        return self.total_bytes - len(self._head) - len(self._tail)

    def kept(self) -> tuple[bytes, bytes]:
        """The kept head and tail as bytes (for a caller that returns them undecoded)."""
        return bytes(self._head), bytes(self._tail)

    def result(self, transform: Callable[[str], str] | None = None) -> CapturedStream:
        """Decode (UTF-8, invalid bytes replaced) and mark the gap if anything was dropped."""
        dropped = self.dropped_bytes
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if transform is not None:
            head, tail = transform(head), transform(tail)
        text = head + TRUNCATION_MARKER.format(dropped=dropped) + tail if dropped else head + tail
        return CapturedStream(
            text=text, truncated=dropped > 0, dropped_bytes=dropped, total_bytes=self.total_bytes
        )

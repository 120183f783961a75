"""Measuring a workspace without letting the measurement become the drain.

Depth, largest file and (without a tmpfs) file count need a walk. A walk of a
tree that a hostile task controls must be bounded, so:
- each ``scan`` spends at most ``budget_s``, then resumes next tick where it
  stopped (values found so far are lower bounds, valid for a violation);
- when the filesystem's fingerprint (statvfs inodes and blocks in use, the root
  directory's mtime) has not moved since the last complete walk, the walk is
  skipped and the previous values stand, so an idle sandbox costs one statvfs;
- symlinks are never followed; only ``lstat`` data is used; a full re-walk is
  forced every ``full_rescan_every`` ticks to catch renames that move a tree
  deeper without changing any count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

FULL_RESCAN_EVERY: Final = 15


@dataclass(frozen=True, slots=True)
class ScanResult:
    file_count: int
    max_depth: int
    largest_file_bytes: int
    total_bytes: int
    complete: bool  # False while a budget-limited walk is still in progress
    walked: bool  # False when the fingerprint let us skip the walk


@dataclass
class _Walk:
    stack: list[tuple[str, int]]
    current: Iterator[os.DirEntry[str]] | None = None
    current_depth: int = 0
    file_count: int = 0
    max_depth: int = 0
    largest: int = 0
    total: int = 0


class WorkspaceScanner:
    """Incremental, time-bounded walker of one workspace."""

    def __init__(
        self, root: Path, *, budget_s: float = 0.2, full_rescan_every: int = FULL_RESCAN_EVERY
    ) -> None:
        self.root = root
        self.budget_s = budget_s
        self.full_rescan_every = full_rescan_every
        self._walk: _Walk | None = None
        self._last: ScanResult | None = None
        self._fingerprint: tuple[int, int, int] | None = None
        self._ticks_since_full = 0
        self._pending_fp: tuple[int, int, int] | None = None
        self.walks_started = 0

    def _fp(self) -> tuple[int, int, int] | None:
        try:
            st = os.statvfs(self.root)
            mtime = os.lstat(self.root).st_mtime_ns
        except OSError:
            return None
        # Only a filesystem of its own (our tmpfs) makes statvfs a fingerprint of this tree.
        if st.f_files == 0:
            return None
        return (st.f_files - st.f_ffree, st.f_blocks - st.f_bfree, mtime)

    def _is_own_fs(self) -> bool:
        try:
            return os.lstat(self.root).st_dev != os.lstat(self.root.parent).st_dev
        except OSError:
            return False

    def scan(self, *, need_count: bool = True) -> ScanResult | None:
        """One tick's worth of measuring; ``None`` if the workspace is gone."""
        del need_count  # the walk counts anyway; the caller prefers statvfs when it has it
        self._ticks_since_full += 1
        fp = self._fp() if self._is_own_fs() else None
        if (
            self._walk is None
            and self._last is not None
            and fp is not None
            and fp == self._fingerprint
            and self._ticks_since_full < self.full_rescan_every
        ):
            last = self._last
            return ScanResult(
                last.file_count,
                last.max_depth,
                last.largest_file_bytes,
                last.total_bytes,
                complete=True,
                walked=False,
            )
        if self._walk is None:
            if not self.root.is_dir():
                return None
            self._walk = _Walk(stack=[(str(self.root), 0)])
            self._pending_fp = fp
            self.walks_started += 1
        done = self._advance(self._walk, time.monotonic() + self.budget_s)
        w = self._walk
        if done:
            result = ScanResult(w.file_count, w.max_depth, w.largest, w.total, True, True)
            self._last = result
            self._fingerprint = self._pending_fp
            self._walk = None
            self._ticks_since_full = 0
            return result
        prev = self._last
        return ScanResult(
            max(w.file_count, prev.file_count if prev else 0),
            max(w.max_depth, prev.max_depth if prev else 0),
            max(w.largest, prev.largest_file_bytes if prev else 0),
            max(w.total, prev.total_bytes if prev else 0),
            complete=False,
            walked=True,
        )

    @staticmethod
    def _advance(w: _Walk, deadline: float) -> bool:
        checks = 0
        while True:
            if w.current is None:
                if not w.stack:
                    return True
                path, depth = w.stack.pop()
                try:
                    w.current = iter(os.scandir(path))
                except OSError:
                    continue
                w.current_depth = depth
            for entry in w.current:
                w.file_count += 1
                try:
                    if entry.is_dir(follow_symlinks=False):
                        d = w.current_depth + 1
                        w.max_depth = max(w.max_depth, d)
                        w.stack.append((entry.path, d))
                    elif entry.is_file(follow_symlinks=False):
                        size = entry.stat(follow_symlinks=False).st_size
                        w.total += size
                        w.largest = max(w.largest, size)
                except OSError:
                    pass
                checks += 1
                if checks & 63 == 0 and time.monotonic() > deadline:
                    return False
            w.current = None

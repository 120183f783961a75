"""Measuring a workspace without letting the measurement become the drain.

Depth, largest file and (without a tmpfs) file count need a walk. A walk of a
tree that a hostile task controls must be bounded and cheap when nothing moved:

- when the workspace is its own filesystem (our tmpfs) and its fingerprint
  (statvfs inodes and blocks in use, the root's mtime) has not moved since the
  last complete walk, nothing is walked: an idle sandbox costs one statvfs (plus
  an incremental walk every ``recheck_every`` ticks, for renames that move a tree
  deeper without changing a count). Any change of bytes in use re-stats every
  file, since a file can grow without its directory changing;
- otherwise the walk is incremental: a directory whose mtime is unchanged since
  it was last listed (and was not "racy", i.e. modified within the timestamp
  granularity of that listing, as git treats its index) is not listed again,
  only ``lstat``-ed, and its cached counts stand;
- each ``scan`` spends at most ``budget_s`` and resumes next tick where it
  stopped; values found so far are lower bounds, so a violation seen in a
  partial walk is real;
- without a filesystem of its own, every ``full_rescan_every`` ticks the cache is
  ignored, to catch what mtimes cannot show (a file growing in place);
- symlinks are never followed; only ``lstat`` data is used.

Depth counts directories below the workspace root: ``a/b/c/`` is depth 3.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

FULL_RESCAN_EVERY: Final = 150  # without tmpfs: re-stat every file every ~5 min at 2 s
RECHECK_EVERY: Final = 15  # with tmpfs: an incremental walk every ~30 s even when idle
RACY_NS: Final = 50_000_000  # mtime this close to the listing may hide a later change


@dataclass(frozen=True, slots=True)
class ScanResult:
    file_count: int
    max_depth: int
    largest_file_bytes: int
    total_bytes: int
    complete: bool  # False while a budget-limited walk is still in progress
    walked: bool  # False when the fingerprint let us skip the walk
    dirs_listed: int = 0


@dataclass(slots=True)
class _Dir:
    mtime_ns: int
    entries: int
    subdirs: tuple[str, ...]
    largest: int
    total: int
    racy: bool


@dataclass
class _Listing:
    """A directory being listed, possibly across ticks."""

    path: str
    depth: int
    mtime_ns: int
    it: Any
    entries: int = 0
    subdirs: list[str] = field(default_factory=list)
    largest: int = 0
    total: int = 0


@dataclass
class _Walk:
    stack: list[tuple[str, int]]
    full: bool
    current: _Listing | None = None
    seen: set[str] = field(default_factory=set)
    file_count: int = 0
    max_depth: int = 0
    largest: int = 0
    total: int = 0
    listed: int = 0


class WorkspaceScanner:
    """Incremental, time-bounded walker of one workspace."""

    def __init__(
        self,
        root: Path,
        *,
        walk_roots: list[Path] | None = None,
        budget_s: float = 0.2,
        full_rescan_every: int = FULL_RESCAN_EVERY,
        recheck_every: int = RECHECK_EVERY,
    ) -> None:
        self.root = root
        # The directories walked, each at depth 0 (a sandbox's workspace and its /tmp,
        # /var/tmp and /dev/shm); ``root`` is what the filesystem fingerprint reads.
        self.walk_roots = walk_roots or [root]
        self.budget_s = budget_s
        self.full_rescan_every = full_rescan_every
        self.recheck_every = recheck_every
        self._ticks_since_walk = 0
        self._walk: _Walk | None = None
        self._last: ScanResult | None = None
        self._fingerprint: tuple[int, int, int] | None = None
        self._pending_fp: tuple[int, int, int] | None = None
        self._cache: dict[str, _Dir] = {}
        self._ticks_since_full = 0
        self.walks_started = 0

    def _fp(self) -> tuple[int, int, int] | None:
        """statvfs of our own filesystem: a fingerprint of the whole tree in one syscall."""
        try:
            if os.lstat(self.root).st_dev == os.lstat(self.root.parent).st_dev:
                return None  # shares a filesystem: statvfs says nothing about this tree
            st = os.statvfs(self.root)
            mtime = os.lstat(self.root).st_mtime_ns
        except OSError:
            return None
        if st.f_files == 0:
            return None
        return (st.f_files - st.f_ffree, st.f_blocks - st.f_bfree, mtime)

    def scan(self) -> ScanResult | None:
        """One tick's worth of measuring; ``None`` if the workspace is gone."""
        self._ticks_since_full += 1
        self._ticks_since_walk += 1
        fp = self._fp()
        last = self._last
        if self._walk is None:
            if fp is not None and last is not None and self._fingerprint is not None:
                if fp == self._fingerprint and self._ticks_since_walk < self.recheck_every:
                    return ScanResult(
                        last.file_count,
                        last.max_depth,
                        last.largest_file_bytes,
                        last.total_bytes,
                        complete=True,
                        walked=False,
                    )
                # Bytes moved: some file changed size, maybe in a directory that did not.
                full = fp[1] != self._fingerprint[1]
            else:
                full = last is None or self._ticks_since_full >= self.full_rescan_every
            if not self.root.is_dir():
                return None
            self._walk = _Walk(stack=[(str(r), 0) for r in reversed(self.walk_roots)], full=full)
            self._pending_fp = fp
            self._ticks_since_walk = 0
            self.walks_started += 1
        w = self._walk
        done = self._advance(w, time.monotonic() + self.budget_s)
        if done:
            result = ScanResult(w.file_count, w.max_depth, w.largest, w.total, True, True, w.listed)
            # Forget directories that no longer exist.
            for gone in set(self._cache) - w.seen:
                del self._cache[gone]
            self._last = result
            self._fingerprint = self._pending_fp
            self._walk = None
            if w.full:
                self._ticks_since_full = 0
            return result
        return ScanResult(
            max(w.file_count, last.file_count if last else 0),
            max(w.max_depth, last.max_depth if last else 0),
            max(w.largest, last.largest_file_bytes if last else 0),
            max(w.total, last.total_bytes if last else 0),
            complete=False,
            walked=True,
            dirs_listed=w.listed,
        )

    def _advance(self, w: _Walk, deadline: float) -> bool:
        checks = 0
        while True:
            if w.current is None:
                if not w.stack:
                    return True
                # Always make some progress, however small the budget.
                if checks and time.monotonic() > deadline:
                    return False
                checks += 1
                path, depth = w.stack.pop()
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                w.seen.add(path)
                w.max_depth = max(w.max_depth, depth)
                cached = self._cache.get(path)
                if (
                    not w.full
                    and cached is not None
                    and not cached.racy
                    and cached.mtime_ns == st.st_mtime_ns
                ):
                    w.file_count += cached.entries
                    w.largest = max(w.largest, cached.largest)
                    w.total += cached.total
                    w.stack.extend((f"{path}/{n}", depth + 1) for n in cached.subdirs)
                    continue
                try:
                    it = os.scandir(path)
                except OSError:
                    continue
                w.current = _Listing(path, depth, st.st_mtime_ns, it)
                w.listed += 1
            cur = w.current
            # Resumable: a directory with a million entries is listed over several ticks.
            for entry in cur.it:
                cur.entries += 1
                w.file_count += 1
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISDIR(mode):
                        cur.subdirs.append(entry.name)
                    elif stat.S_ISREG(mode):
                        size = entry.stat(follow_symlinks=False).st_size
                        cur.total += size
                        w.total += size
                        if size > cur.largest:
                            cur.largest = size
                            w.largest = max(w.largest, size)
                except OSError:
                    pass
                checks += 1
                if checks & 255 == 0 and time.monotonic() > deadline:
                    return False
            cur.it.close()
            racy = time.time_ns() - cur.mtime_ns < RACY_NS
            self._cache[cur.path] = _Dir(
                cur.mtime_ns, cur.entries, tuple(cur.subdirs), cur.largest, cur.total, racy
            )
            w.stack.extend((f"{cur.path}/{n}", cur.depth + 1) for n in cur.subdirs)
            w.current = None


# -- unpacking a tree that came from a sandbox --------------------------------------------
def unpack_tar(data: bytes, target: Path) -> list[str]:
    """Extract a tar archive into ``target`` (made 0700 if missing) by tarfile's ``data``
    rules: no absolute paths, no ``..``, nothing written through a link out of ``target``,
    no links out, no devices, no setuid/setgid/sticky or group/other write bits, owners
    not set. Returns the archive's top-level names. Raises ``tarfile.TarError``."""
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        tops = list(dict.fromkeys(Path(m.name).parts[0] for m in members if m.name))
        if hasattr(tarfile, "data_filter"):
            # Every member checked before the first is written: a refused archive leaves
            # nothing behind (extraction checks each again against the tree it makes).
            for member in members:
                tarfile.data_filter(member, str(target))
            tar.extractall(target, filter="data")
        else:  # Python before 3.11.4 (Debian bookworm's 3.11.2): the same rules, by hand
            _extract_data_only(tar, target)
    return tops


def _extract_data_only(tar: tarfile.TarFile, target: Path) -> None:
    """``filter="data"`` where tarfile lacks it: regular files, directories and symlinks
    only, each checked against the tree as extracted so far (a link made by an earlier
    member counts), nothing outside ``target``, no setuid/setgid/sticky or world-write
    bits. Raises ``tarfile.TarError``."""
    root = os.path.realpath(target)
    # Owners are not the archive's to set (the data filter ignores them too).
    tar.chown = lambda *_args, **_kwargs: None  # type: ignore[method-assign]

    def inside(path: str) -> bool:
        return os.path.commonpath([root, os.path.realpath(path)]) == root

    for member in tar.getmembers():  # what can be told without the tree: all first
        if Path(member.name).is_absolute() or ".." in Path(member.name).parts:
            raise tarfile.TarError(f"{member.name!r}: a path out of the target")
        if member.issym() and Path(member.linkname).is_absolute():
            raise tarfile.TarError(f"{member.name!r}: a link to an absolute path")
        if not (member.isfile() or member.isdir() or member.issym()):
            raise tarfile.TarError(f"{member.name!r}: not a regular file, directory or symlink")
    for member in tar.getmembers():
        name = member.name
        dest = str(Path(root) / name)
        if not inside(dest):
            raise tarfile.TarError(f"{name!r}: would be written outside the target")
        if member.issym():
            link = str(Path(dest).parent / member.linkname)
            if Path(member.linkname).is_absolute() or not inside(link):
                raise tarfile.TarError(f"{name!r}: a link out of the target")
        elif not (member.isfile() or member.isdir()):
            raise tarfile.TarError(f"{name!r}: not a regular file, directory or symlink")
        member.mode &= 0o755 if member.isdir() or member.mode & 0o100 else 0o644
        tar.extract(member, root, set_attrs=not member.issym())

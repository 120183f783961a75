"""Samplers of a command's process tree, for the lifecycle's exec watchdog.

``ProcessStatsSource`` (``base.py``) is the seam: ``PsutilProcessStats`` reads the host
(I/O: psutil), ``ScriptedProcessStats`` replays samples for tests, as ``FakeDriver``
does for drivers.

What is measured (``PsutilProcessStats``):

- The tree is the exec's leader (its host pid, from the driver's ``on_start``) and all
  its descendants, plus every process of the sandbox's cgroup (the driver's
  ``member_pids``), so a double fork re-parented out of the tree still counts. The
  launch stages (shim, bwrap) count too: they take 1-4 MiB and no CPU, noise against
  any useful limit, and filtering processes by name would let a command named
  ``bwrap`` hide.
- RSS is the sum over the tree. Shared pages count once per process, so the sum
  over-states a little; that errs towards killing. PSS would be exact but reads
  ``smaps`` and costs about a hundred times more per process.
- CPU% is the tree's CPU time (user + system, plus what reaped children used) since the
  previous sample, over the wall time in between, x 100: 100 is one core.
- Runnable% adds the time the members waited on a run queue (Linux: the second field of
  ``/proc/<pid>/schedstat``, the process's main thread): what the tree demanded, which a
  loaded host does not grant. A busy loop is runnable 100% of the time even when it gets
  86% of a core. ``None`` where schedstat cannot be read (other systems, kernels without
  ``CONFIG_SCHED_INFO``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import psutil

from devs_sandbox.models import TreeSample
from devs_sandbox.monitors.usage import ONE_CORE_PERCENT

logger = logging.getLogger(__name__)


SCHEDSTAT: Final = Path("/proc/self/schedstat").exists()


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds ``pid``'s main thread has waited on a run queue; ``None`` if the host does
    not say. A process that exited since the listing waited 0 s more (deltas are clamped).
    """
    if not SCHEDSTAT:
        return None
    try:
        fields = Path(f"/proc/{pid}/schedstat").read_bytes().split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    except OSError:
        return None
    try:
        return int(fields[1]) / 1e9
    except (IndexError, ValueError):
        return None


class PsutilProcessStats:
    """``ProcessStatsSource`` over psutil (Linux, macOS, Windows); one instance per tree.

    Finding a tree means knowing every host process's parent. ``Process.children()``
    reads all of them and builds a ``Process`` per descendant on every call: 7-9 ms a
    sample for a 50-process tree on a 100-170-process host, more as the host grows.
    This class keeps the host's pid -> parent table between samples instead. Each
    sample lists pids (one directory read), reads the parent of new pids only, re-reads
    orphans (a parent changes only when the old one dies), walks the tree, and reads
    each member once (``oneshot``: stat and statm on Linux). Cost then follows the tree
    and the host's churn, not the host's size: 2-3 ms for the same tree
    (``benchmarks/sampling.py``). The first sample learns the whole table (~20 ms).

    Known limit: a parent that dies and whose pid is reused before the next sample
    hides its orphans from the tree until the impostor exits; with a 32768-pid space
    that needs tens of thousands of forks within one interval.
    """

    UNREADABLE: Final = -1  # parent of a live pid we may not inspect: never in our tree

    def __init__(self, members: Callable[[], Iterable[int]] | None = None) -> None:
        """``members``: every pid of the command's sandbox (its cgroup), added to the ppid
        tree with their own descendants. A double fork re-parents the grandchild to the
        host's init (no pid namespace) or the container's: out of the tree, never out of
        the cgroup."""
        self._members = members
        self._parent: dict[int, int] = {}
        self._procs: dict[int, psutil.Process] = {}
        # (monotonic time, tree CPU seconds, tree run-queue wait seconds or None)
        self._last: tuple[float, float, float | None] | None = None

    def _learn(self, pid: int) -> None:
        try:
            self._parent[pid] = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            self._parent.pop(pid, None)  # gone since the listing: gone from the next one too
        except psutil.AccessDenied:
            self._parent[pid] = self.UNREADABLE

    def _tree(self, root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid, parent in self._parent.items():
            children.setdefault(parent, []).append(pid)
        tree = [root]
        seen = {root}
        for pid in tree:  # grows while we walk it: breadth first
            for child in children.get(pid, ()):
                if child not in seen:  # a recycled pid could close a loop in stale data
                    seen.add(child)
                    tree.append(child)
        return tree

    def sample(self, pid: int) -> TreeSample | None:
        live = set(psutil.pids())
        if pid not in live:
            return None
        for gone in self._parent.keys() - live:
            del self._parent[gone]
        for new in live - self._parent.keys():
            self._learn(new)
        # An orphan was re-parented (to bwrap's init, a subreaper or the host's init) when
        # its recorded parent died; nothing else changes a parent, so only these are re-read.
        for orphan in [p for p, parent in self._parent.items() if parent > 0]:
            if self._parent[orphan] not in self._parent:
                self._learn(orphan)
        tree = self._tree(pid)
        if self._members is not None:
            try:
                extra = [m for m in self._members() if m in live]
            except Exception:
                logger.exception("listing the sandbox's processes failed")
                extra = []
            in_tree = set(tree)
            for m in extra:
                if m not in in_tree:
                    for member in self._tree(m):
                        if member not in in_tree:
                            in_tree.add(member)
                            tree.append(member)
        now = time.monotonic()
        rss = 0
        cpu_s = 0.0
        wait_s: float | None = 0.0
        counted = 0
        for member in tree:
            proc = self._procs.get(member)
            if proc is None:
                try:
                    proc = self._procs[member] = psutil.Process(member)
                except psutil.NoSuchProcess:
                    continue
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    rss += proc.memory_info().rss
            except psutil.NoSuchProcess:  # exited and reaped since the listing
                continue
            # A zombie still reports its CPU times (and 0 RSS) until it is reaped.
            cpu_s += times.user + times.system + times.children_user + times.children_system
            counted += 1
            if wait_s is not None:
                waited = run_queue_wait_s(member)
                wait_s = None if waited is None else wait_s + waited
        for stale in self._procs.keys() - set(tree):
            del self._procs[stale]
        cpu_percent: float | None = None
        runnable_percent: float | None = None
        interval_s: float | None = None
        if self._last is not None and now > self._last[0]:
            last_at, last_cpu, last_wait = self._last
            interval_s = now - last_at
            # Clamped: a member that left the tree alive takes its past CPU time with it.
            used = max(0.0, cpu_s - last_cpu)
            cpu_percent = used / interval_s * ONE_CORE_PERCENT
            if wait_s is not None and last_wait is not None:
                waited = max(0.0, wait_s - last_wait)
                runnable_percent = (used + waited) / interval_s * ONE_CORE_PERCENT
        self._last = (now, cpu_s, wait_s)
        return TreeSample(
            rss_bytes=rss,
            cpu_percent=cpu_percent,
            processes=counted,
            runnable_percent=runnable_percent,
            interval_s=interval_s,
        )


class ScriptedProcessStats:
    """A ``ProcessStatsSource`` that replays a script, as ``FakeDriver`` does for drivers.

    Items are served in order, the last one repeating: a ``TreeSample``, ``None`` (the
    command has exited) or an exception instance, which is raised. ``calls`` records the
    pid of every sample taken, so tests can count them.
    """

    def __init__(self, script: Iterable[TreeSample | BaseException | None]) -> None:
        self._script = list(script)
        if not self._script:
            raise ValueError("the script needs at least one item")
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def sample(self, pid: int) -> TreeSample | None:
        with self._lock:
            self.calls.append(pid)
            item = self._script[min(len(self.calls), len(self._script)) - 1]
        if isinstance(item, BaseException):
            raise item
        return item

"""One cgroup per sandbox, on cgroup v2 or v1, for caps, accounting and a total kill.

Why a cgroup: a process group misses a grandchild that called ``setsid``; a
cgroup holds every descendant whatever it does, and the kernel enforces its
memory and pids limits where RLIMIT_NPROC is ignored for root.

Layout (both fixed, so ``cleanup`` and operators know where to look):
- v2: ``<cgroup2 mount>/devs-sandbox/<id>`` with memory, pids (and cpu) enabled;
- v1: ``<controller mount>/devs-sandbox/<id>`` in each of memory, pids, cpuacct,
  and cpu / freezer where mounted.

Which version is used is detected from ``/proc/self/mountinfo``: v2 when its
root offers memory and pids, else v1 when both controllers are mounted (as on
hosts with a hybrid hierarchy, where cgroup2 at ``/sys/fs/cgroup/unified``
carries no controllers).

Kernel docs: Documentation/admin-guide/cgroup-v2.rst (cgroup.kill, memory.events,
pids.events), cgroup-v1/memory.rst (memory.oom_control), cgroup-v1/pids.rst,
cgroup-v1/freezer-subsystem.rst.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from devs_sandbox.models import validate_sandbox_id

BASE_NAME: Final = "devs-sandbox"
V1_CONTROLLERS: Final = ("memory", "pids", "cpuacct", "cpu", "freezer")
V1_REQUIRED: Final = ("memory", "pids")
KILL_DEADLINE_S: Final = (
    5.0  # a frozen, SIGKILLed cgroup empties in ms; 5 s means the kernel is stuck
)
REMOVE_DEADLINE_S: Final = 2.0  # rmdir may see EBUSY while exiting tasks leave the css_set


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    memory_bytes: int | None = None
    pids_max: int | None = None
    cpu_cores: float | None = None


@dataclass(frozen=True, slots=True)
class CgroupCounters:
    """Cumulative counters and current gauges of one sandbox cgroup."""

    pids_current: int | None = None
    pids_peak: int | None = None
    pids_limit_hits: int | None = None
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
    oom_kills: int | None = None
    cpu_time_s: float | None = None


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """What the host offers; ``reason`` says why not when ``version`` is None."""

    version: int | None
    mounts: dict[str, Path] = field(default_factory=dict)  # controller -> mount point (v1)
    unified: Path | None = None
    reason: str = ""
    controllers: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return self.version is not None


def _parse_mountinfo(text: str) -> tuple[Path | None, dict[str, Path]]:
    unified: Path | None = None
    v1: dict[str, Path] = {}
    for line in text.splitlines():
        # mountinfo: ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        mountpoint = Path(fields[4].replace("\\040", " "))
        fstype = rfields[0]
        if fstype == "cgroup2" and unified is None:
            unified = mountpoint
        elif fstype == "cgroup":
            for opt in rfields[2].split(","):
                if opt in V1_CONTROLLERS and opt not in v1:
                    v1[opt] = mountpoint
    return unified, v1


def detect(mountinfo: str | None = None, *, require_writable: bool = True) -> CgroupSupport:
    """Probe which cgroup version can host sandboxes here, and why not if none."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError as exc:
            return CgroupSupport(None, reason=f"cannot read /proc/self/mountinfo: {exc}")
    unified, v1 = _parse_mountinfo(mountinfo)
    reasons: list[str] = []
    if unified is not None:
        try:
            ctrls = (unified / "cgroup.controllers").read_text().split()
        except OSError:
            ctrls = []
        if "memory" in ctrls and "pids" in ctrls:
            if require_writable and not os.access(unified, os.W_OK):
                reasons.append(f"cgroup v2 at {unified} is not writable (run as root)")
            else:
                wanted = tuple(c for c in ("memory", "pids", "cpu") if c in ctrls)
                return CgroupSupport(2, unified=unified, controllers=wanted)
        else:
            reasons.append(
                f"cgroup v2 at {unified} lacks the memory/pids controllers "
                f"(has: {' '.join(ctrls) or 'none'})"
            )
    missing = [c for c in V1_REQUIRED if c not in v1]
    if not missing:
        not_writable = [c for c in V1_REQUIRED if not os.access(v1[c], os.W_OK)]
        if require_writable and not_writable:
            reasons.append(f"cgroup v1 {', '.join(not_writable)} not writable (run as root)")
        else:
            return CgroupSupport(1, mounts=dict(v1), unified=unified, controllers=tuple(v1))
    elif v1:
        reasons.append(f"cgroup v1 lacks {', '.join(missing)}")
    if unified is None and not v1:
        reasons.append("no cgroup filesystem mounted")
    return CgroupSupport(None, unified=unified, reason="; ".join(reasons))


def _write(path: Path, value: str) -> None:
    with path.open("w") as f:
        f.write(value)


class SandboxCgroup:
    """The cgroup(s) of one sandbox. ``create`` then ``add``; ``kill_all``; ``remove``."""

    def __init__(
        self,
        support: CgroupSupport,
        sandbox_id: str,
        *,
        controllers: tuple[str, ...] | None = None,
        dirs: Mapping[str, Path] | None = None,
    ) -> None:
        """``controllers`` (v1 only) picks the hierarchies to join: each one costs a write to
        its cgroup.procs per exec, and on v1 that write takes most of a millisecond
        (cgroup_attach waits for an RCU grace period). Default: all mounted ones, which is
        what destroy and the reaper need to find everything.

        ``dirs`` attaches to directories outside our layout instead (v1 controller or
        ``"unified"`` -> path): a container's cgroups as the engine made them, or a child
        cgroup we make inside one to find and kill a single exec's processes."""
        if not support.available:
            raise RuntimeError("cgroups unavailable: " + support.reason)
        if dirs is None:
            # The id becomes a path component under our base: ".." would be the root cgroup
            # of the hierarchy, and kill_all would then kill the host.
            validate_sandbox_id(sandbox_id)
        self.support = support
        self.sandbox_id = sandbox_id
        self.dirs: dict[str, Path] = {}
        # Control files read on every poll stay open: pread(fd, .., 0) re-reads a cgroup
        # file in ~1 us, open/read/close costs ~15 us, and 100 sandboxes poll them.
        self._named_fds: dict[tuple[str, str], int] = {}
        self._fd_lock = threading.Lock()
        self._closed = False  # set by close(): no control file is opened again
        if dirs is not None:
            self.dirs.update(dirs)
        elif support.version == 2:
            assert support.unified is not None
            self.dirs["unified"] = support.unified / BASE_NAME / sandbox_id
        else:
            for ctrl, mnt in support.mounts.items():
                if controllers is None or ctrl in controllers:
                    self.dirs[ctrl] = mnt / BASE_NAME / sandbox_id

    @classmethod
    def from_paths(cls, support: CgroupSupport, sandbox_id: str) -> SandboxCgroup:
        """Re-attach to every hierarchy a sandbox may have used, by id (destroy, reaper)."""
        return cls(support, sandbox_id)

    @staticmethod
    def controllers_for(limits: CgroupLimits) -> tuple[str, ...]:
        """v1 hierarchies a sandbox needs: memory and pids always, cpuacct for CPU time (rusage
        loses everything bwrap's pid namespace reaps), cpu for a CPU cap."""
        wanted = ["memory", "pids", "cpuacct"]
        if limits.cpu_cores is not None:
            wanted.append("cpu")
        return tuple(wanted)

    @property
    def paths(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def _dir(self, ctrl: str) -> Path | None:
        if self.support.version == 2:
            return self.dirs["unified"]
        return self.dirs.get(ctrl)

    # -- lifecycle ----------------------------------------------------------------------
    def create(self, limits: CgroupLimits) -> None:
        if self.support.version == 2:
            self._create_v2(limits)
        else:
            self._create_v1(limits)

    def _create_v2(self, limits: CgroupLimits) -> None:
        assert self.support.unified is not None
        base = self.support.unified / BASE_NAME
        enable = " ".join(f"+{c}" for c in self.support.controllers)
        if not base.is_dir():
            with contextlib.suppress(FileExistsError):
                base.mkdir()
        # Controllers must be enabled top-down: in the root's and then in our base's
        # subtree_control. Writing an already enabled controller is a no-op.
        for parent in (self.support.unified, base):
            present = (parent / "cgroup.subtree_control").read_text().split()
            if any(c not in present for c in self.support.controllers):
                _write(parent / "cgroup.subtree_control", enable)
        d = self.dirs["unified"]
        d.mkdir()
        if limits.memory_bytes is not None:
            _write(d / "memory.max", str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                _write(d / "memory.swap.max", "0")  # no swap escape
            with contextlib.suppress(OSError):
                _write(d / "memory.oom.group", "1")  # an OOM kills the whole sandbox
        if limits.pids_max is not None:
            _write(d / "pids.max", str(limits.pids_max))
        if limits.cpu_cores is not None and "cpu" in self.support.controllers:
            period = 100_000
            _write(d / "cpu.max", f"{max(1000, int(limits.cpu_cores * period))} {period}")

    def _create_v1(self, limits: CgroupLimits) -> None:
        for d in self.paths:
            if not d.parent.is_dir():
                with contextlib.suppress(FileExistsError):
                    d.parent.mkdir()
            d.mkdir()
        mem = self.dirs.get("memory")
        if mem is not None and limits.memory_bytes is not None:
            _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
            # memsw exists only with swap accounting; it must be >= limit_in_bytes.
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                with contextlib.suppress(OSError):
                    _write(memsw, str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                _write(mem / "memory.swappiness", "0")
        pids = self.dirs.get("pids")
        if pids is not None and limits.pids_max is not None:
            _write(pids / "pids.max", str(limits.pids_max))
        cpu = self.dirs.get("cpu")
        if cpu is not None and limits.cpu_cores is not None:
            period = 100_000
            _write(cpu / "cpu.cfs_period_us", str(period))
            _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu_cores * period))))

    def make_dirs(self) -> None:
        """mkdir every directory, setting no limit: a child cgroup that only groups processes
        (inherits the parent's limits; v1 freezer or v2 cgroup.kill reach all of it)."""
        for d in self.paths:
            d.mkdir()

    def self_join_files(self) -> list[str]:
        """v1: the ``tasks`` files a single-threaded process writes "0" into to move itself
        (no global lock, unlike a pid written into cgroup.procs). v2: none; ``add``."""
        if self.support.version != 1:
            return []
        return [str(d / "tasks") for d in self.paths]

    def add(self, pid: int) -> None:
        """Move ``pid`` (not yet exec'd, so it has no children) into every hierarchy."""
        for d in self.paths:
            _write(d / "cgroup.procs", str(pid))

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.paths)

    def pids(self) -> list[int]:
        d = self._dir("pids") or self.paths[0]
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def all_pids(self) -> list[int]:
        """Pids of this cgroup and of every child cgroup under it (v1 cgroup.procs lists a
        directory's own members only; the docker driver puts each exec in a child)."""
        top = self._dir("pids") or self.paths[0]
        found: list[int] = []
        for d, _subdirs, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    found += [int(x) for x in Path(d, "cgroup.procs").read_text().split()]
        return found

    def _file(self, ctrl: str, name: str) -> Path | None:
        """The control file ``name`` of controller ``ctrl`` (v2: all in one directory)."""
        d = self._dir(ctrl)
        return None if d is None else d / name

    def _read(self, ctrl: str, name: str) -> str | None:
        # Keyed by (ctrl, name): building Path objects cost more than the read itself.
        key = (ctrl, name)
        with self._fd_lock:
            if self._closed:
                return None  # being removed: a reopened fd would pin a dying cgroup
            fd = self._named_fds.get(key)
            if fd is None:
                path = self._file(ctrl, name)
                if path is None:
                    return None
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    return None
                self._named_fds[key] = fd
            try:
                return os.pread(fd, 4096, 0).decode()
            except OSError:
                self._named_fds.pop(key, None)
                os.close(fd)
                return None

    def _int(self, ctrl: str, name: str) -> int | None:
        raw = self._read(ctrl, name)
        if raw is None or raw.strip() == "max":
            return None
        try:
            return int(raw)
        except ValueError:
            return None

    def _keyed(self, ctrl: str, name: str, key: str) -> int | None:
        raw = self._read(ctrl, name)
        if raw is None:
            return None
        for line in raw.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                try:
                    return int(parts[1])
                except ValueError:
                    return None
        return None

    def close(self) -> None:
        """Close the cached control files for good (before rmdir, when the sandbox goes)."""
        with self._fd_lock:
            self._closed = True
            fds, self._named_fds = self._named_fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def cpu_time_s(self) -> float | None:
        if self.support.version == 2:
            usec = self._keyed("cpu", "cpu.stat", "usage_usec")
            return None if usec is None else usec / 1e6
        ns = self._int("cpuacct", "cpuacct.usage")
        return None if ns is None else ns / 1e9

    def pids_current(self) -> int | None:
        return self._int("pids", "pids.current")

    def counters(self) -> CgroupCounters:
        v2 = self.support.version == 2
        return CgroupCounters(
            pids_current=self._int("pids", "pids.current"),
            pids_peak=self._int("pids", "pids.peak"),
            pids_limit_hits=self._keyed("pids", "pids.events", "max"),
            memory_bytes=self._int("memory", "memory.current" if v2 else "memory.usage_in_bytes"),
            peak_memory_bytes=self._int(
                "memory", "memory.peak" if v2 else "memory.max_usage_in_bytes"
            ),
            oom_kills=self._keyed(
                "memory", "memory.events" if v2 else "memory.oom_control", "oom_kill"
            ),
            cpu_time_s=self.cpu_time_s(),
        )

    def kill_all(self, deadline_s: float = KILL_DEADLINE_S) -> bool:
        """SIGKILL every process in the sandbox, forks racing us included; True when empty."""
        if not self.exists():
            return True
        if self.support.version == 2:
            kill_file = self.dirs["unified"] / "cgroup.kill"
            if kill_file.exists():
                with contextlib.suppress(OSError):
                    _write(kill_file, "1")
                return self._wait_empty(deadline_s)
        freezer = self._freezer_state_file()
        end = time.monotonic() + deadline_s
        while True:
            frozen = self._freeze(freezer, True) if freezer else False
            victims = self.pids()
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if frozen:
                self._freeze(freezer, False)  # SIGKILL is delivered once thawed
            if not victims or self._wait_empty(0.05):
                return True
            if time.monotonic() > end:
                return False

    def _freezer_state_file(self) -> Path | None:
        if self.support.version == 2:
            f = self.dirs["unified"] / "cgroup.freeze"
        else:
            fd = self.dirs.get("freezer")
            if fd is None:
                return None
            f = fd / "freezer.state"
        return f if f.exists() else None

    def _freeze(self, state_file: Path | None, frozen: bool) -> bool:
        if state_file is None:
            return False
        v2 = self.support.version == 2
        value = ("1" if frozen else "0") if v2 else ("FROZEN" if frozen else "THAWED")
        try:
            _write(state_file, value)
        except OSError:
            return False
        if not frozen or v2:
            return True
        # v1 passes through FREEZING; give it a moment so no task forks during the sweep.
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            try:
                if state_file.read_text().strip() == "FROZEN":
                    return True
            except OSError:
                return False
            time.sleep(0.001)
        return True

    def _wait_empty(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            if not self.pids():
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def remove(self) -> list[str]:
        """Kill what is left and rmdir every hierarchy; returns paths that could not go."""
        self.close()
        left: list[str] = []
        if self.exists() and self.pids():
            self.kill_all()
        for d in self.paths:
            if not d.exists():
                continue
            end = time.monotonic() + REMOVE_DEADLINE_S
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > end:
                        left.append(f"{d}: {exc.strerror}")
                        break
                    self.kill_all(0.2)
                    time.sleep(0.005)
        return left


def cgroup_dirs_of(pid: int, support: CgroupSupport) -> dict[str, Path]:
    """The directories ``pid`` lives in, per v1 controller we know (or ``"unified"`` on v2),
    read from /proc/<pid>/cgroup, which names them relative to our cgroup namespace (the
    host's for a host process: a container's full path such as ``/docker/<id>``)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return {}
    dirs: dict[str, Path] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        rel = rel.lstrip("/")
        if support.version == 2:
            if hierarchy == "0" and support.unified is not None:
                return {"unified": support.unified / rel}
            continue
        for ctrl in controllers.split(","):
            mount = support.mounts.get(ctrl)
            if mount is not None:
                dirs[ctrl] = mount / rel
    return dirs


def list_sandbox_cgroups(support: CgroupSupport) -> set[str]:
    """Ids that have a cgroup under our base in any hierarchy (for the orphan reaper)."""
    bases: list[Path] = []
    if support.version == 2 and support.unified is not None:
        bases.append(support.unified / BASE_NAME)
    else:
        bases.extend(m / BASE_NAME for m in support.mounts.values())
    ids: set[str] = set()
    for base in bases:
        with contextlib.suppress(OSError):
            ids.update(p.name for p in base.iterdir() if p.is_dir())
    return ids

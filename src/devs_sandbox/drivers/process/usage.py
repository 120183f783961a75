"""What a sandbox uses and holds, read from its cgroup and its tmpfs (the kernel's own
counters), else from the exec's rusage and a scan of its files."""

from __future__ import annotations

import contextlib
import os
import resource
import time

from devs_sandbox.drivers.linux import count_session
from devs_sandbox.drivers.process.state import Box
from devs_sandbox.models import ResourceUsage, SandboxMetrics


def sample_processes(box: Box, leader: int) -> None:
    """Raise the sandbox's peak process count to what runs now (session ``leader``'s)."""
    n: int | None = None
    if box.cgroup is not None:
        n = box.cgroup.pids_current()
    if n is None:
        n = count_session(leader)
    if n is not None and n > box.peak_processes:
        box.peak_processes = n


def usage(
    box: Box,
    rusage: resource.struct_rusage | None,
    wall_s: float,
    cpu_before: float | None,
) -> ResourceUsage:
    """One exec's resources: cgroup counters (CPU since ``cpu_before``, peak memory and
    processes), else the leader's rusage."""
    cpu: float | None = None
    peak_mem: int | None = None
    if box.cgroup is not None:
        c = box.cgroup.counters()
        if c.cpu_time_s is not None and cpu_before is not None:
            cpu = max(0.0, c.cpu_time_s - cpu_before)
        peak_mem = c.peak_memory_bytes
        if c.pids_peak is not None:  # pids.peak (Linux 6.1+): exact, not sampled
            box.peak_processes = max(box.peak_processes, c.pids_peak)
    if rusage is not None:
        # Without a cgroup: the leader's rusage, which holds every process that was waited
        # for up its tree (the namespace's init waits for the command, and the launcher
        # for the init): a lower bound when orphans were never reaped.
        if cpu is None:
            cpu = rusage.ru_utime + rusage.ru_stime
        if peak_mem is None:
            peak_mem = rusage.ru_maxrss * 1024  # Linux reports KiB
    # The shim and bwrap count as processes of the sandbox while they run.
    peak = max(box.peak_processes, 1)
    return ResourceUsage(
        cpu_time_s=cpu, peak_memory_bytes=peak_mem, peak_processes=peak, wall_time_s=wall_s
    )


def running(box: Box) -> bool:
    """Whether any process of the sandbox is alive."""
    if box.cgroup is not None:
        current = box.cgroup.pids_current()
        if current is not None:
            return current > 0
        if box.cgroup.pids():
            return True
    with box.lock:
        return any(p.poll() is None for p in box.procs.values())


def metrics(box: Box) -> SandboxMetrics:
    """A sample for the watchdog's policies."""
    counters = box.cgroup.counters() if box.cgroup is not None else None
    procs = counters.pids_current if counters is not None else None
    if procs is None:
        with box.lock:
            leaders = list(box.procs)
        procs = sum(count_session(pid) or 0 for pid in leaders)
    box.peak_processes = max(box.peak_processes, procs)
    file_count: int | None = None
    disk: int | None = None
    inodes_free: int | None = None
    disk_free: int | None = None
    if box.mounted:
        # One statvfs gives count, bytes and headroom of our own tmpfs: everything the task
        # wrote in its workspace, /tmp, /var/tmp and /dev/shm.
        with contextlib.suppress(OSError):
            st = os.statvfs(box.root)
            file_count = max(0, st.f_files - st.f_ffree - box.base_inodes)
            disk = (st.f_blocks - st.f_bfree) * st.f_frsize
            inodes_free = st.f_ffree
            disk_free = st.f_bavail * st.f_frsize
    scan = box.scanner.scan() if box.scanner else None
    if scan is not None:
        if file_count is None:
            file_count = scan.file_count
        if disk is None:
            disk = scan.total_bytes
    return SandboxMetrics(
        sandbox_id=box.id,
        timestamp=time.monotonic(),
        process_count=procs,
        memory_bytes=counters.memory_bytes if counters else None,
        peak_memory_bytes=counters.peak_memory_bytes if counters else None,
        cpu_time_s=counters.cpu_time_s if counters else None,
        file_count=file_count,
        directory_depth=scan.max_depth if scan else None,
        largest_file_bytes=scan.largest_file_bytes if scan else None,
        disk_bytes=disk,
        inodes_free=inodes_free,
        disk_free_bytes=disk_free,
        pids_limit_hits=counters.pids_limit_hits if counters else None,
        oom_kills=counters.oom_kills if counters else None,
        running=running(box),
    )

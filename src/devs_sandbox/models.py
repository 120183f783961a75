"""Plain data that crosses the seams: drivers return it, monitors read it, the store keeps it.

Everything here is a frozen dataclass or an enum with no behaviour beyond
conversion, so that a driver written for another backend (Docker, Kubernetes)
produces exactly the same records as the process driver.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from devs_sandbox.errors import InvalidSandboxIdError, SandboxCommandError

# The id becomes a directory name, a cgroup name and a Docker label: keep it to a
# charset that is inert in all three (and in SQL, though we only bind parameters).
SANDBOX_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# An environment variable a POSIX shell can export (the process driver exports them).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def validate_sandbox_id(sandbox_id: str) -> str:
    """Return ``sandbox_id`` unchanged or raise naming what is wrong with it."""
    if not isinstance(sandbox_id, str) or not SANDBOX_ID_PATTERN.fullmatch(sandbox_id):
        raise InvalidSandboxIdError(
            f"invalid sandbox id {sandbox_id!r}: use 1-64 letters, digits, '.', '_' or '-'",
            key="sandbox_id",
        )
    if sandbox_id in {".", ".."}:
        raise InvalidSandboxIdError(
            f"invalid sandbox id {sandbox_id!r}: '.' and '..' are path components",
            key="sandbox_id",
        )
    return sandbox_id


def new_sandbox_id() -> str:
    """A fresh id; 48 random bits are plenty for the sandboxes alive on one host."""
    return f"sb-{uuid.uuid4().hex[:12]}"


def utc_now_iso() -> str:
    """Audit timestamps: ISO 8601, UTC, millisecond precision, 'Z' suffix."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ViolationType(StrEnum):
    """Why a sandbox was terminated; stored verbatim in ``sandbox_violations.violation_type``."""

    FILE_COUNT_EXCEEDED = "FILE_COUNT_EXCEEDED"
    PROCESS_COUNT_EXCEEDED = "PROCESS_COUNT_EXCEEDED"
    DIRECTORY_DEPTH_EXCEEDED = "DIRECTORY_DEPTH_EXCEEDED"
    FILE_SIZE_EXCEEDED = "FILE_SIZE_EXCEEDED"
    MEMORY_EXCEEDED = "MEMORY_EXCEEDED"
    DISK_QUOTA_EXCEEDED = "DISK_QUOTA_EXCEEDED"
    CPU_EXCEEDED = "CPU_EXCEEDED"  # run_shell_monitored: a full core for cpuSustainedMs


class DetectionRule(StrEnum):
    """Which rule caught a violation, so an operator can tell a spike from a trend."""

    THRESHOLD = "threshold"  # a sample was above the limit
    GROWTH = "growth"  # sustained growth would cross the limit within the look-ahead
    KERNEL = "kernel"  # the kernel refused or killed (pids.events, oom_kill, SIGXFSZ, ENOSPC)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken limit: the row written to ``sandbox_violations``."""

    sandbox_id: str
    type: ViolationType
    observed_value: int
    limit_value: int
    rule: DetectionRule = DetectionRule.THRESHOLD
    detail: str = ""
    violation_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    terminated_at: str = field(default_factory=utc_now_iso)

    def to_json(self) -> dict[str, Any]:
        """The shape ``run --json`` prints under ``violation``."""
        return {
            "type": str(self.type),
            "observed_value": self.observed_value,
            "limit_value": self.limit_value,
            "rule": str(self.rule),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """What a sandbox consumed, as isolate's meta file reports it; ``None`` = not measurable."""

    cpu_time_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_processes: int | None = None
    wall_time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "cpu_time_s": None if self.cpu_time_s is None else round(self.cpu_time_s, 6),
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_processes": self.peak_processes,
            "wall_time_s": round(self.wall_time_s, 6),
        }


@dataclass(frozen=True, slots=True)
class CapturedStream:
    """One captured stream: the kept head and tail, and what was dropped between them."""

    text: str = ""
    truncated: bool = False
    dropped_bytes: int = 0
    total_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The result of one command inside a sandbox.

    ``exit_code`` follows the shell convention: the command's status, or
    128 + N when signal N killed it, so one integer carries both cases.
    """

    exit_code: int
    stdout: CapturedStream
    stderr: CapturedStream
    duration_s: float
    timed_out: bool = False
    idle_timed_out: bool = False
    signal: int | None = None
    resources: ResourceUsage = field(default_factory=ResourceUsage)

    @property
    def killed(self) -> bool:
        return self.signal is not None


@dataclass(frozen=True, slots=True)
class SandboxMetrics:
    """One sample of a live sandbox, as cheap as the driver can make it.

    Fields a driver cannot measure are ``None``; monitors skip them.
    Counters (``pids_limit_hits``, ``oom_kills``) are cumulative since provision.
    """

    sandbox_id: str
    timestamp: float  # time.monotonic() of the sample
    process_count: int | None = None
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
    cpu_time_s: float | None = None
    file_count: int | None = None
    directory_depth: int | None = None
    largest_file_bytes: int | None = None
    disk_bytes: int | None = None
    inodes_free: int | None = None  # of the workspace's own filesystem (tmpfs), else None
    disk_free_bytes: int | None = None
    pids_limit_hits: int | None = None
    oom_kills: int | None = None
    running: bool = True


@dataclass(frozen=True, slots=True)
class TreeSample:
    """One sample of a command's process tree (run_shell_monitored).

    ``rss_bytes`` sums the resident memory of every process in the tree; ``cpu_percent`` is
    the tree's CPU time since the previous sample over the wall time between them, where
    100 is one core (``None`` on the first sample: no rate yet). ``runnable_percent`` adds
    the time the tree's processes waited for a CPU (``None`` where the host does not
    report it); ``interval_s`` is the wall time since the previous sample (``None``: the
    poll interval).
    """

    rss_bytes: int
    cpu_percent: float | None
    processes: int = 1
    runnable_percent: float | None = None
    interval_s: float | None = None


@dataclass(frozen=True, slots=True)
class SandboxContext:
    """What a driver returns from ``provision``: enough to find every resource again."""

    id: str
    driver: str
    workspace: Path
    isolation: tuple[str, ...]
    created_at: str = field(default_factory=utc_now_iso)
    # Driver-specific identifiers an operator may want to see (container id, cgroup paths).
    labels: dict[str, str] = field(default_factory=dict)
    # Default layers not in effect, each "layer: why" (the operator allowed weaker isolation).
    warnings: tuple[str, ...] = ()

    @property
    def node(self) -> str | None:
        """Where the sandbox runs, for drivers that place it on one of several machines."""
        return self.labels.get("node")


@dataclass(frozen=True, slots=True)
class SandboxOutcome:
    """The result of ``run_in_sandbox``: the task's result plus how the sandbox ended."""

    sandbox_id: str
    driver: str
    isolation: tuple[str, ...]
    result: ExecResult
    violation: Violation | None = None
    timed_out: bool = False
    cancelled: bool = False
    preflight: tuple[ExecResult, ...] = ()
    warnings: tuple[str, ...] = ()  # default layers that were not in effect, and why
    node: str | None = None  # where it ran, for drivers that place sandboxes (ray: node id)

    @property
    def exit_code(self) -> int:
        """timeout(1)'s convention: 124 on timeout, 137 on a quota kill, else the command's."""
        if self.timed_out:
            return 124
        if self.violation is not None:
            return 137
        return self.result.exit_code

    def raise_for_status(self) -> SandboxOutcome:
        """Raise ``SandboxCommandError`` if the task exited non-zero; opt-in, like httpx."""
        if self.exit_code != 0:
            raise SandboxCommandError(
                f"task in sandbox {self.sandbox_id} exited with status {self.exit_code}", self
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """The object ``devs-sandbox run --json`` prints (the CLI contract)."""
        res = self.result
        return {
            "sandbox_id": self.sandbox_id,
            "driver": self.driver,
            "isolation": list(self.isolation),
            "exit_code": self.exit_code,
            "stdout": res.stdout.text,
            "stderr": res.stderr.text,
            "stdout_truncated": res.stdout.truncated,
            "stderr_truncated": res.stderr.truncated,
            "stdout_dropped_bytes": res.stdout.dropped_bytes,
            "stderr_dropped_bytes": res.stderr.dropped_bytes,
            "duration_s": round(res.duration_s, 6),
            "timed_out": self.timed_out,
            "idle_timed_out": res.idle_timed_out,
            "signal": res.signal,
            "resources": {k: v for k, v in res.resources.to_json().items() if k != "wall_time_s"},
            "violation": None if self.violation is None else self.violation.to_json(),
            "warnings": list(self.warnings),
            "node": self.node,
        }


def violation_row(v: Violation) -> dict[str, Any]:
    """The ``sandbox_violations`` row for a violation (column names are the contract)."""
    d = asdict(v)
    return {
        "violation_id": d["violation_id"],
        "sandbox_id": d["sandbox_id"],
        "violation_type": str(v.type),
        "observed_value": int(v.observed_value),
        "limit_value": int(v.limit_value),
        "terminated_at": d["terminated_at"],
        "rule": str(v.rule),
        "detail": v.detail,
    }

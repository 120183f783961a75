"""Owner leases: how a sandbox left behind by a dead process is recognised and reaped.

Every sandbox gets a lease file *before* any of its resources exist, naming
the owning process by pid, start time (so a recycled pid does not count as
alive) and boot id (so nothing survives a reboot's pid reuse). A sandbox whose
owner is gone is an orphan: the next start of any devs-sandbox process, or
``devs-sandbox cleanup``, destroys it.

Leases live outside every workspace (the sandbox cannot forge or delete its own)
in a per-user directory that must be ours and not a symlink, since it sits in a
world-writable temp directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from devs_sandbox.models import utc_now_iso

LEASE_GRACE_S: Final = 60.0  # a lease-less resource younger than this may be mid-provision


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parens: split after the last ')'.
    rest = raw.rsplit(")", 1)[-1].split()
    try:
        return int(rest[19])  # field 22 is the 20th after comm
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    start_ticks: int | None
    boot_id: str

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start_ticks(pid), _boot_id())

    def alive(self) -> bool:
        if self.boot_id and self.boot_id != _boot_id():
            return False
        ticks = process_start_ticks(self.pid)
        if ticks is None:
            return False
        return self.start_ticks is None or ticks == self.start_ticks


@dataclass(frozen=True, slots=True)
class Lease:
    sandbox_id: str
    driver: str
    owner: Owner
    workspace: str
    created_at: str = field(default_factory=utc_now_iso)
    resources: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lease:
        owner = data["owner"]
        return cls(
            sandbox_id=str(data["sandbox_id"]),
            driver=str(data["driver"]),
            owner=Owner(int(owner["pid"]), owner.get("start_ticks"), str(owner.get("boot_id", ""))),
            workspace=str(data["workspace"]),
            created_at=str(data.get("created_at", "")),
            resources=dict(data.get("resources", {})),
        )


def default_lease_dir() -> Path:
    """One directory per user that every devs-sandbox process of that user agrees on.

    It must not depend on TMPDIR: a reaper that looked in another directory would take a
    live sandbox for a lease-less leftover. Root's sandboxes own host-wide resources
    (cgroups, mounts), so root's leases live in /run; a user's in its runtime directory.
    (Not platformdirs: without XDG_RUNTIME_DIR it picks /tmp/runtime-UID, which would move
    the leases of running versions out of their reaper's sight; it knows nothing of /run.)
    """
    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    if uid == 0 and Path("/run").is_dir() and os.access("/run", os.W_OK):
        return Path("/run/devs-sandbox/leases")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "devs-sandbox" / "leases"
    return Path("/tmp") / f"devs-sandbox.leases-{uid}"


class LeaseRegistry:
    """Lease files, one per live sandbox, written atomically (write + rename)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_lease_dir()
        self._checked = False

    def _ensure_dir(self) -> Path:
        d = self.directory
        if not self._checked:
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700, parents=True)
            st = os.lstat(d)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise PermissionError(f"lease directory {d} is not a directory we own")
            if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
                raise PermissionError(f"lease directory {d} belongs to uid {st.st_uid}, not us")
            self._checked = True
        return d

    def path_for(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.json"

    def _stage(self, lease: Lease) -> Path:
        d = self._ensure_dir()
        tmp = d / f".{lease.sandbox_id}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(lease.to_json(), f)
        return tmp

    def write(self, lease: Lease) -> None:
        """Write or replace the lease (atomic rename)."""
        self._stage(lease).replace(self.path_for(lease.sandbox_id))

    def claim(self, lease: Lease) -> bool:
        """Create the lease only if no lease exists for this id (atomic ``link``); False if
        one does, in which case nothing was written. A provision claims before it makes
        anything, so two processes can never both believe they own one id."""
        tmp = self._stage(lease)
        try:
            os.link(tmp, self.path_for(lease.sandbox_id))
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True

    def remove(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_for(sandbox_id).unlink()

    def read(self, sandbox_id: str) -> Lease | None:
        try:
            return Lease.from_json(json.loads(self.path_for(sandbox_id).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def all(self) -> list[tuple[str, Lease | None]]:
        """(sandbox id, lease or None when the file is unreadable) for every lease file."""
        try:
            names = [p for p in self.directory.iterdir() if p.suffix == ".json"]
        except OSError:
            return []
        out: list[tuple[str, Lease | None]] = []
        for p in names:
            out.append((p.stem, self.read(p.stem)))
        return out

    def orphans(self, driver: str | None = None) -> list[tuple[str, Lease | None]]:
        """Leases whose owner is dead, and unreadable ones older than the grace period."""
        out: list[tuple[str, Lease | None]] = []
        now = time.time()
        for sandbox_id, lease in self.all():
            if lease is None:
                try:
                    age = now - self.path_for(sandbox_id).stat().st_mtime
                except OSError:
                    continue
                if age > LEASE_GRACE_S:
                    out.append((sandbox_id, None))
                continue
            if driver is not None and lease.driver != driver:
                continue
            if not lease.owner.alive():
                out.append((sandbox_id, lease))
        return out

    def is_live(self, sandbox_id: str) -> bool:
        lease = self.read(sandbox_id)
        return lease is not None and lease.owner.alive()

"""The host probes' verdicts, kept on disk so that a short-lived process does not spawn
probe sandboxes again (bwrap twice, our unshare launcher, a scratch tmpfs: ~30 ms).

A verdict is reused only while nothing that could change it has changed. The key covers
the binaries the probes ran (path, inode, size, mtime), the kernel (release and build),
our credentials (euid, capability sets, no_new_privs, a seccomp filter of our own, the
user namespace we are in), the sysctls that gate user namespaces, and this package's
version; an entry older than ``MAX_AGE_S`` is probed again whatever the key says.

Trust: the file lives in a directory of ours only (``/run/devs-sandbox`` for root, the
runtime directory otherwise), mode 0700, neither a symlink nor anybody else's; a file
that is not ours, or open to others, is ignored. Sandboxes never see it (the state
directory and /run/user are hidden, /tmp is private). A stale "works" fails closed
anyway: the launcher then cannot build the sandbox and the command never runs. A stale
"does not work" refuses the run (or, where the operator allowed weaker isolation, says
so in its warnings). ``devs-sandbox doctor`` always probes afresh and rewrites the file.

``DEVS_SANDBOX_PROBE_CACHE=0`` turns the cache off; ``=<dir>`` moves it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

T = TypeVar("T")

MAX_AGE_S: Final = 3600.0
FILE_NAME: Final = "host-probe.json"
ENV: Final = "DEVS_SANDBOX_PROBE_CACHE"
FORMAT: Final = 1
_SYSCTLS: Final = (
    "/proc/sys/kernel/unprivileged_userns_clone",
    "/proc/sys/user/max_user_namespaces",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
)
_STATUS_FIELDS: Final = ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")


def directory() -> Path | None:
    """Where the cache lives for us, or None when it is off."""
    chosen = os.environ.get(ENV)
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen)
    if os.geteuid() == 0:
        return Path("/run/devs-sandbox")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and runtime.startswith("/"):
        return Path(runtime) / "devs-sandbox"
    return None  # no private runtime directory: probe every time


def _ours(st: os.stat_result, *, want_dir: bool) -> bool:
    kind = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    return kind and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _binary(name: str) -> list[Any]:
    path = shutil.which(name)
    if path is None:
        return [name, None]
    try:
        st = Path(path).stat()
    except OSError:
        return [name, path, None]
    return [name, path, st.st_ino, st.st_size, st.st_mtime_ns]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


@functools.cache
def fingerprint() -> str:
    """What the verdicts depend on, hashed; computed once per process."""
    from devs_sandbox import __version__  # noqa: PLC0415 - lazily exported

    status = _read("/proc/self/status") or ""
    creds = [ln for ln in status.splitlines() if ln.split(":", 1)[0] in _STATUS_FIELDS]
    try:
        userns = Path("/proc/self/ns/user").stat().st_ino
    except OSError:
        userns = None
    uname = os.uname()
    key = {
        "format": FORMAT,
        "version": __version__,
        "python": sys.version,
        "kernel": [uname.release, uname.version],
        "euid": os.geteuid(),
        "creds": creds,
        "userns": userns,
        "sysctls": [_read(p) for p in _SYSCTLS],
        "binaries": [_binary(n) for n in ("bwrap", "setpriv", "sh")],
        # The probes' own code (a development checkout changes it without a new version).
        "code": sorted((p.name, p.stat().st_mtime_ns) for p in Path(__file__).parent.glob("*.py")),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _file() -> Path | None:
    d = directory()
    return None if d is None else d / FILE_NAME


def _load() -> dict[str, Any]:
    path = _file()
    if path is None:
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not _ours(os.fstat(fd), want_dir=False) or not _ours(
            os.lstat(path.parent), want_dir=True
        ):
            return {}
        with os.fdopen(os.dup(fd), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("key") != fingerprint():
        return {}
    written = data.get("written_at")
    if not isinstance(written, int | float) or not 0 <= time.time() - written <= MAX_AGE_S:
        return {}
    results = data.get("results")
    return results if isinstance(results, dict) else {}


def lookup(name: str) -> Any:
    """The verdict stored under ``name`` for this host as it is now, or None."""
    return _load().get(name)


def store(name: str, value: Any) -> None:
    """Record a verdict (JSON-serialisable); best effort, atomically (write + rename)."""
    path = _file()
    if path is None:
        return
    try:
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=0o700, parents=True)
        if not _ours(os.lstat(path.parent), want_dir=True):
            return
        results = _load()
        results[name] = value
        data = {"key": fingerprint(), "written_at": time.time(), "results": results}
        tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        tmp.replace(path)
    except OSError:
        return


def invalidate() -> None:
    """Forget every verdict (``reprobe``)."""
    path = _file()
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def cached(
    name: str,
    probe: Callable[[], T],
    *,
    encode: Callable[[T], Any],
    decode: Callable[[Any], T],
) -> T:
    """``probe()``'s verdict, from the cache when it holds one for this host."""
    hit = lookup(name)
    if hit is not None:
        with contextlib.suppress(TypeError, ValueError):
            return decode(hit)
    value = probe()
    store(name, encode(value))
    return value

"""The driver's side of ``nsinit``, our unshare(2) launcher: its command line, its spec, its
probe.

``nsinit.py`` runs as a separate interpreter (``python -I -S``: no site-packages, no
environment variables honoured, standard library only), started by the same exec
shim as bwrap, so the rlimits and cgroups the shim gives it hold for everything it
starts. The spec travels on a memfd, never on argv (world-readable in /proc).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from devs_sandbox.isolation import layout as layout_mod
from devs_sandbox.isolation import probe_cache

SCRIPT: Final = Path(__file__).with_name("nsinit.py")
PROBE_TIMEOUT_S: Final = 10.0  # an interpreter start plus a few mounts; 10 s means wedged


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data`` at offset 0 (never on disk; nothing
    blocks the way a full pipe would). Inheritable: it is meant for a child."""
    fd = os.memfd_create(name, 0)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def argv(spec_fd: int, command: Sequence[str]) -> list[str]:
    return [sys.executable, "-I", "-S", str(SCRIPT), str(spec_fd), "--", *command]


def spec(
    lay: layout_mod.Layout | None,
    *,
    userns: bool,
    uid: int,
    gid: int,
    env_fd: int,
    seccomp_fd: int | None,
    status_fd: int | None,
    network_namespace: bool = True,
    info_fd: int | None = None,
    block_fd: int | None = None,
) -> dict[str, Any]:
    """``lay`` None: no namespaces at all, only the privilege drop and the seccomp filter
    (a run the operator allowed to go without namespaces still gets those)."""
    return {
        "namespaces": lay is not None,
        "userns": userns,
        "uid": uid,
        "gid": gid,
        "ops": layout_mod.to_spec(lay) if lay is not None else [],
        "chdir": lay.chdir if lay is not None else "",
        "hostname": lay.hostname if lay is not None else "",
        "env_fd": env_fd,
        "seccomp_fd": seccomp_fd,
        "status_fd": status_fd,
        "network_namespace": network_namespace,
        "info_fd": info_fd,
        "block_fd": block_fd,
    }


def env_blob(env: Mapping[str, str]) -> bytes:
    return b"\0".join(f"{k}={v}".encode() for k, v in env.items())


@functools.cache
def probe(*, userns: bool, uid: int) -> tuple[bool, str]:
    """Run a trivial sandbox once, the way the driver will, to learn whether unshare(2),
    the mounts and the privilege drop all work here (kept on disk: ``probe_cache``)."""
    return probe_cache.cached(
        f"unshare userns={userns} uid={uid}",
        lambda: probe_now(userns=userns, uid=uid),
        encode=list,
        decode=lambda v: (bool(v[0]), str(v[1])),
    )


def probe_now(*, userns: bool, uid: int) -> tuple[bool, str]:
    """The probe itself, never cached."""
    ops = (
        layout_mod.Op("ro-bind", "/", src="/"),
        layout_mod.Op("proc", "/proc"),
        layout_mod.Op("dev", "/dev"),
        layout_mod.Op("tmpfs", "/tmp", mode=0o1777, size_bytes=1 << 20),
    )
    lay = layout_mod.Layout(ops, chdir="/")
    env_fd = memfd("devs-sandbox-env", env_blob({"PATH": "/usr/bin:/bin"}))
    status_r, status_w = os.pipe()
    gid = uid
    spec_fd = -1
    try:
        spec_fd = memfd(
            "devs-sandbox-nsinit",
            json.dumps(
                spec(
                    lay,
                    userns=userns,
                    uid=uid if not userns else os.getuid(),
                    gid=gid if not userns else os.getgid(),
                    env_fd=env_fd,
                    seccomp_fd=None,
                    status_fd=status_w,
                )
            ).encode(),
        )
        try:
            proc = subprocess.run(
                argv(spec_fd, ["true"]),
                pass_fds=(spec_fd, env_fd, status_w),
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
                env={"PATH": "/usr/bin:/bin"},
                cwd="/",
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"unshare launcher failed to start: {exc}"
        os.close(status_w)
        status_w = -1
        why = os.read(status_r, 4096).decode(errors="replace").strip()
    finally:
        for fd in (env_fd, status_r, status_w, spec_fd):
            if fd >= 0:
                os.close(fd)
    if proc.returncode != 0:
        detail = why or proc.stderr.decode(errors="replace").strip() or f"exit {proc.returncode}"
        detail = detail.removeprefix("devs-sandbox-nsinit: ")
        how = "in a user namespace" if userns else "as root"
        return False, f"unshare(2) {how} cannot build a sandbox here: {detail}"
    return True, ""

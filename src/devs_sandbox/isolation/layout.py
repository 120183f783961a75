"""What a sandbox sees of the filesystem, once, for every namespace launcher.

The mount layout is data: an ordered list of operations in bubblewrap's vocabulary,
which ``bwrap.render`` turns into bwrap arguments and ``nsinit`` (our unshare(2)
launcher, for hosts where bwrap is missing or cannot create namespaces) performs
itself. One layout, two mechanisms: a hardening added here holds at both levels.

The layout of a sandbox whose private root is ``R`` (a tmpfs as root, sized by the
disk quota and the file quota; a directory otherwise) and whose workspace is
``R/workspace``:

- the host's root read-only; the configured hidden paths, the cgroup hierarchy
  (``/sys/fs/cgroup``: other sandboxes' ids and usage) and our own state
  directory covered; the sandbox's own cgroup directories bound back read-only,
  so runtimes that size themselves from ``memory.max`` still can;
- fresh ``/proc`` (the pid namespace's) and a minimal ``/dev``;
- ``/tmp``, ``/var/tmp`` and ``/dev/shm`` bound from ``R/tmp``, ``R/var-tmp`` and
  ``R/shm``: everything a task can write lives in ``R``, so one filesystem counts
  it against the quotas and one unmount removes it;
- the workspace at its host path; secrets on a per-exec tmpfs of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

OpKind = Literal["ro-bind", "bind", "tmpfs", "proc", "dev", "dev-null", "dir", "file"]

# Under R: what each area is called; the workspace is what commands run in.
WORKSPACE_DIR: Final = "workspace"
TMP_DIRS: Final = {"/tmp": "tmp", "/var/tmp": "var-tmp", "/dev/shm": "shm"}
SECRETS_DIR: Final = "/tmp/.devs-secrets"  # a per-exec tmpfs inside the sandbox's /tmp
SECRETS_TMPFS_BYTES: Final = 4 * 1024 * 1024  # room for a few keys; never on disk
CGROUP_ROOT: Final = "/sys/fs/cgroup"
# The sandbox's own controllers it may read (runtimes size heaps and thread pools from
# memory.max and cpu.max); cpuacct and freezer are ours, not the task's business.
CGROUP_SHOWN: Final = frozenset({"unified", "memory", "pids", "cpu"})
# Our own state that a sandbox must not read (lease files name every live sandbox).
STATE_DIRS: Final = ("/run/devs-sandbox",)


@dataclass(frozen=True, slots=True)
class Op:
    """One mount operation. ``dest`` is a path inside the sandbox; ``src`` a host path."""

    kind: OpKind
    dest: str
    src: str = ""
    size_bytes: int | None = None
    mode: int | None = None
    fd: int | None = None
    owned: bool = False  # a tmpfs the sandbox's uid owns (bwrap in a user ns does this itself)


@dataclass(frozen=True, slots=True)
class Layout:
    ops: tuple[Op, ...]
    chdir: str
    hostname: str = "devs-sandbox"
    # fds the launcher must be given (secret files); the caller closes them.
    fds: tuple[int, ...] = field(default=())


def sandbox_areas(root: Path) -> dict[str, Path]:
    """Host paths of the areas under a sandbox root: workspace, tmp, var-tmp, shm."""
    out = {"workspace": root / WORKSPACE_DIR}
    out.update({name: root / name for name in TMP_DIRS.values()})
    return out


def hidden_ops(hide_paths: Sequence[str]) -> Iterator[Op]:
    """Cover each existing host path: a directory with an empty tmpfs, anything else (a
    socket, a file) with /dev/null. Paths are resolved first: bwrap does not follow a
    symlink in a destination (/var/run -> /run)."""
    for hidden in dict.fromkeys(os.path.realpath(h) for h in hide_paths):
        p = Path(hidden)
        if p.is_dir():
            yield Op("tmpfs", hidden, mode=0o755)
        elif p.exists():
            yield Op("dev-null", hidden)


def build(
    *,
    root: Path,
    hide_paths: Sequence[str],
    cgroup_dirs: Mapping[str, Path] | None = None,
    secret_fds: Mapping[str, int] | None = None,
    hide_state: bool = True,
    chdir: Path | None = None,
) -> Layout:
    """The layout of one exec of the sandbox rooted at ``root`` (see the module docstring).

    ``cgroup_dirs``: the sandbox's own cgroup directories (v1 controller or ``unified``
    -> host path), bound read-only where the sandbox expects them.
    ``secret_fds``: name -> readable fd holding the value; written to
    ``SECRETS_DIR/NAME``, 0400, on a tmpfs that lives as long as the exec (when the
    sandbox root is itself a tmpfs, the driver writes them there once instead).
    ``hide_state``: cover our state directories (lease files name every live sandbox);
    needed only when the sandbox runs as root, since they are 0700 and ours.
    """
    areas = sandbox_areas(root)
    workspace = str(areas["workspace"])
    ops: list[Op] = [Op("ro-bind", "/", src="/")]
    ops += hidden_ops(tuple(hide_paths) + (STATE_DIRS if hide_state else ()))
    if Path(CGROUP_ROOT).is_dir():
        ops.append(Op("tmpfs", CGROUP_ROOT, mode=0o755, size_bytes=64 * 1024))
        for ctrl, path in sorted((cgroup_dirs or {}).items()):
            if ctrl not in CGROUP_SHOWN:
                continue
            dest = CGROUP_ROOT if ctrl == "unified" else f"{CGROUP_ROOT}/{ctrl}"
            ops.append(Op("ro-bind", dest, src=str(path)))
    ops += [Op("proc", "/proc"), Op("dev", "/dev")]
    for dest, name in TMP_DIRS.items():
        ops.append(Op("bind", dest, src=str(root / name)))
    ops.append(Op("bind", workspace, src=workspace))
    fds: list[int] = []
    if secret_fds:
        ops.append(Op("tmpfs", SECRETS_DIR, mode=0o500, size_bytes=SECRETS_TMPFS_BYTES, owned=True))
        for name, fd in secret_fds.items():
            ops.append(Op("file", f"{SECRETS_DIR}/{name}", fd=fd, mode=0o400))
            fds.append(fd)
    return Layout(tuple(ops), chdir=str(chdir) if chdir is not None else workspace, fds=tuple(fds))


def secret_path(name: str) -> str:
    """Where a secret's file is inside a namespaced sandbox."""
    return f"{SECRETS_DIR}/{name}"


def to_spec(layout: Layout) -> list[dict[str, object]]:
    """The layout as nsinit's JSON spec reads it."""
    return [
        {
            "kind": op.kind,
            "dest": op.dest,
            "src": op.src,
            "size_bytes": op.size_bytes,
            "mode": op.mode,
            "fd": op.fd,
            "owned": op.owned,
        }
        for op in layout.ops
    ]

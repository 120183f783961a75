"""What a sandbox's private root holds: the workspace, its own /tmp, /var/tmp and
/dev/shm, the mount points a launcher needs inside them, the secrets, and a copy of the
caller's files. Made at provision, under the root's tmpfs when there is one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from devs_sandbox.drivers.process.state import SECRETS_DIR_IN_WORKSPACE, Box
from devs_sandbox.errors import ProvisionError
from devs_sandbox.isolation import layout


def structure(box: Box) -> list[tuple[Path, int, bool]]:
    """Directories under the sandbox root, in creation order: (path, mode, owned by the
    sandbox). The workspace (0700) and the sandbox's /tmp, /var/tmp and /dev/shm (1777,
    as those are); with namespaces, the mount points a launcher needs inside them (ours:
    the task cannot remove or swap them)."""
    areas = layout.sandbox_areas(box.root)
    out = [(path, 0o700 if name == "workspace" else 0o1777, True) for name, path in areas.items()]
    if box.launcher is None:
        return out
    for dest, area in layout.TMP_DIRS.items():
        rel = _relative_to(box.workspace, Path(dest))
        if rel is not None:
            for i in range(1, len(rel.parts) + 1):
                out.append((box.root / area / Path(*rel.parts[:i]), 0o755, False))
    out.append((box.root / "tmp" / Path(layout.SECRETS_DIR).name, 0o500, False))
    return out


def make_areas(box: Box) -> None:
    chown = box.uid != os.geteuid()
    for path, mode, owned in structure(box):
        path.mkdir(mode=mode)
        path.chmod(mode)  # mkdir's mode passes through the umask
        if owned and chown:
            os.chown(path, box.uid, box.gid)


def place_secrets(box: Box) -> None:
    """Secrets as files, mode 0400, owned by the sandbox uid, never on a disk. In a
    namespaced sandbox whose root is a tmpfs (as root) they are written once into its
    /tmp/.devs-secrets; whose root is a plain directory (unprivileged), each exec gets
    them through pipes onto a tmpfs of its own (``secret_pipes``). Without namespaces
    they are files in the workspace (a tmpfs as root), removed with it."""
    if box.launcher is not None:
        box.secret_paths = {n: layout.secret_path(n) for n in box.secrets}
        if not box.mounted:
            return
        d = box.root / "tmp" / Path(layout.SECRETS_DIR).name
        box.secrets_placed = True
    else:
        d = box.workspace / SECRETS_DIR_IN_WORKSPACE
        d.mkdir(mode=0o700)
    d.chmod(0o700)
    for name, value in box.secrets.items():
        path = d / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        try:
            os.write(fd, value)
        finally:
            os.close(fd)
        if box.uid != os.geteuid():
            os.chown(path, box.uid, box.gid)
        if box.launcher is None:
            box.secret_paths[name] = str(path)
    d.chmod(0o500)
    if box.uid != os.geteuid():
        os.chown(d, box.uid, box.gid)


def secret_pipes(box: Box) -> dict[str, int]:
    """One pipe per secret, already filled and closed for writing: the launcher copies it
    into a file of its private tmpfs (bwrap's ``--file``). The value never touches argv."""
    fds: dict[str, int] = {}
    try:
        for name, value in box.secrets.items():
            r, w = os.pipe()
            fds[name] = r
            try:
                os.write(w, value)
            finally:
                os.close(w)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def copy_in(box: Box, source: Path) -> None:
    """The caller's directory into the workspace, symlinks as symlinks, owned by the
    sandbox; the tmpfs's size and inode count bound what fits."""
    if not source.is_dir():
        raise ProvisionError(f"--copy-in {source}: not a directory")
    try:
        shutil.copytree(source, box.workspace, symlinks=True, dirs_exist_ok=True)
    except shutil.Error as exc:
        raise ProvisionError(
            f"--copy-in {source}: could not copy everything "
            "(more files than quotas.fileCountLimit or bytes than quotas.diskBytes?): "
            f"{exc.args[0][0][2] if exc.args and exc.args[0] else exc}"
        ) from exc
    except OSError as exc:
        raise ProvisionError(
            f"--copy-in {source}: {exc.strerror} "
            "(more files than quotas.fileCountLimit or bytes than quotas.diskBytes?)"
        ) from exc
    if box.uid != os.geteuid():
        for root, dirs, files in os.walk(box.workspace):
            for name in (*dirs, *files):
                os.lchown(Path(root) / name, box.uid, box.gid)


def _relative_to(path: Path, base: Path) -> Path | None:
    try:
        return path.relative_to(base)
    except ValueError:
        return None

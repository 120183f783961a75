"""Namespaces without bubblewrap: our own unshare(2) launcher, for hosts where bwrap is
missing or cannot create namespaces (a container where mounting a fresh /proc from a
user namespace is refused, a minimal image without the package).

Run as a script, never imported by the sandbox: ``python -I -S nsinit.py SPEC_FD --
COMMAND...`` (standard library only: no site-packages, no environment). SPEC_FD holds a
JSON spec that the process driver wrote to a memfd: the mount layout of
``isolation.layout`` (the same one bubblewrap gets), the namespaces, the uid to run as,
the seccomp program and the command's environment.

What it does, in the order the kernel needs:

1. ``unshare`` pid, mount, ipc, uts, cgroup (and network unless the sandbox has one
   joined by pasta) namespaces; as an unprivileged caller, a user namespace too, with
   the caller's uid mapped to itself (user_namespaces(7));
2. fork: this process stays outside as the waiter (the driver's leader process) and
   exits with the child's status, or 128 + N when signal N killed it, as bwrap does;
   the child is pid 1 of the new pid namespace, so when it dies the kernel kills
   everything left in the namespace (pid_namespaces(7)), and it dies with the waiter
   (PR_SET_PDEATHSIG);
3. the child builds the new root the way bubblewrap does: a tmpfs base, the old root
   moved under it with pivot_root(2), each layout op performed from ``/oldroot`` into
   ``/newroot``, read-only binds made read-only recursively (mount_setattr(2)), then
   ``pivot_root(".", ".")`` into the new root and the old one detached;
4. it drops privileges for good (no_new_privs, empty bounding and ambient sets, the
   sandbox's uid and gid with no supplementary groups, or an empty capability set in
   its own user namespace), installs the seccomp program, and execs the command.

Any failure before the exec is reported on the status fd (if given) and the child exits
125; the command never runs with half a sandbox.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# The namespace's pid 1: a shell that starts the command as pid 2 (with its stdin, which a
# background job would otherwise lose to /dev/null) and exits with its status (128 + N for
# signal N). The command must not be pid 1: the kernel drops signals a pid 1 sent itself
# without a handler (`kill -TERM $$` would do nothing), as bwrap's own init avoids too.
INIT_SH = 'exec 3<&0; "$@" <&3 3<&- & wait $!'
INIT_NAME = "devs-sandbox-init"
EXIT_SETUP_FAILED = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

# x86_64 and aarch64 numbers for the calls glibc may not wrap.
_SYSCALLS = {
    "x86_64": {"pivot_root": 155, "mount_setattr": 442, "capset": 126},
    "aarch64": {"pivot_root": 41, "mount_setattr": 442, "capset": 91},
}
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _syscall(name: str, *args: Any) -> int:
    machine = os.uname().machine
    number = _SYSCALLS.get(machine, {}).get(name)
    if number is None:
        raise SetupError(f"{name}: unsupported architecture {machine}")
    return int(_libc.syscall(ctypes.c_long(number), *args))


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _libc.mount(
        None if src is None else src.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None if data is None else data.encode(),
    )
    _check(rc, f"mount {src or fstype} on {target}")


def _umount(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def _prctl(option: int, arg: int = 0) -> None:
    rc = _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    _check(rc, f"prctl {option}")


def _write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        os.lseek(fd, 0, os.SEEK_SET)  # a memfd the driver wrote; a pipe cannot seek
    except OSError as exc:
        if exc.errno != errno.ESPIPE:
            raise
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


# -- mounts ---------------------------------------------------------------------------------
def _make_readonly(target: str) -> None:
    """Every mount at and below ``target`` read-only (a recursive bind alone leaves the
    submounts writable). mount_setattr(2) does it in one call on Linux 5.12+; older
    kernels get one remount per submount, keeping the flags a user namespace locks."""
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, 0, 0)  # attr_set, clr, propagation, fd
    rc = _syscall("mount_setattr", AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr), 32)
    if rc == 0:
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
        _check(rc, f"mount_setattr {target}")
    for mnt, flags in _submounts(target):
        _mount(None, mnt, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)


def _submounts(target: str) -> list[tuple[str, int]]:
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    out: list[tuple[str, int]] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4].replace("\\040", " ")
            if mnt == target or mnt.startswith(target.rstrip("/") + "/"):
                flags = 0
                for opt in fields[5].split(","):
                    flags |= keep.get(opt, 0)
                out.append((mnt, flags))
    return out


def _ensure_dir(path: str, mode: int = 0o755) -> None:
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
    except OSError as exc:
        raise SetupError(f"mkdir {path}: {exc.strerror}") from None


def _ensure_mountpoint(dest: str, src: str) -> None:
    """The destination of a bind: a directory for a directory, a file for anything else."""
    if os.path.lexists(dest):
        return
    if os.path.isdir(src):
        _ensure_dir(dest)
        return
    _ensure_dir(os.path.dirname(dest))
    try:
        os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o444))
    except OSError as exc:
        raise SetupError(f"create {dest}: {exc.strerror}") from None


def _op(op: dict[str, Any], owner: tuple[int, int] | None) -> None:
    kind = op["kind"]
    dest = "/newroot" + op["dest"].rstrip("/") if op["dest"] != "/" else "/newroot"
    src = "/oldroot" + op["src"] if op.get("src") else ""
    mode = op.get("mode")
    if kind in ("ro-bind", "bind"):
        _ensure_mountpoint(dest, src)
        _mount(src, dest, None, MS_BIND | MS_REC, None)
        if kind == "ro-bind":
            _make_readonly(dest)
    elif kind == "tmpfs":
        _ensure_dir(dest)
        opts = [f"mode={mode if mode is not None else 0o755:o}"]
        if op.get("size_bytes"):
            opts.append(f"size={op['size_bytes']}")
        if owner is not None and op.get("owned"):
            opts += [f"uid={owner[0]}", f"gid={owner[1]}"]
        _mount("tmpfs", dest, "tmpfs", MS_NOSUID | MS_NODEV, ",".join(opts))
    elif kind == "proc":
        _ensure_dir(dest)
        _mount("proc", dest, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    elif kind == "dev":
        _dev(dest)
    elif kind == "dev-null":
        _ensure_mountpoint(dest, "/oldroot/dev/null")
        _mount("/oldroot/dev/null", dest, None, MS_BIND, None)
        _mount(None, dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    elif kind == "dir":
        _ensure_dir(dest, mode if mode is not None else 0o755)
        os.chmod(dest, mode if mode is not None else 0o755)
    elif kind == "file":
        data = _read_all(op["fd"])
        os.close(op["fd"])
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if owner is not None:
                os.fchown(fd, owner[0], owner[1])
            os.fchmod(fd, mode if mode is not None else 0o400)
        finally:
            os.close(fd)
    else:
        raise SetupError(f"unknown layout op {kind!r}")


def _dev(dest: str) -> None:
    """A minimal /dev, as bwrap's --dev: the harmless nodes bound from the host, a private
    devpts, and directories for shm and mqueue."""
    _ensure_dir(dest)
    _mount("tmpfs", dest, "tmpfs", MS_NOSUID, "mode=0755,size=65536")
    for node in DEV_NODES:
        target = f"{dest}/{node}"
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        _mount(f"/oldroot/dev/{node}", target, None, MS_BIND, None)
    for name, link in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        os.symlink(link, f"{dest}/{name}")
    for d in ("shm", "pts", "mqueue"):
        os.mkdir(f"{dest}/{d}", 0o755)
    try:
        _mount(
            "devpts",
            f"{dest}/pts",
            "devpts",
            MS_NOSUID | MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=620",
        )
    except SetupError:
        pass  # no terminal inside; commands run with pipes anyway


def _build_root(spec: dict[str, Any], owner: tuple[int, int] | None) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    # A base tmpfs to pivot into; the old root stays reachable under /oldroot while the
    # layout is assembled in /newroot (bubblewrap's method, bubblewrap.c setup_newroot).
    base = "/tmp"
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=65536")
    os.chdir(base)
    os.mkdir("newroot", 0o755)
    os.mkdir("oldroot", 0o755)
    _check(_syscall("pivot_root", b".", b"oldroot"), "pivot_root to the base")
    os.chdir("/")
    # newroot is a mount point of its own, so pivot_root can make it the root later.
    _mount("/newroot", "/newroot", None, MS_BIND | MS_REC, None)
    for op in spec["ops"]:
        _op(op, owner)
    os.chdir("/newroot")
    _check(_syscall("pivot_root", b".", b"."), "pivot_root into the sandbox")
    _umount(".", MNT_DETACH)  # the base and, under it, the host's root
    os.chdir("/")


# -- privileges -------------------------------------------------------------------------------
def _drop_bounding_set() -> None:
    last = 63
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        pass
    for cap in range(last + 1):
        rc = _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
        if rc != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(rc, f"drop capability {cap} from the bounding set")


def _clear_capabilities() -> None:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: all empty
    _check(_syscall("capset", ctypes.byref(header), ctypes.byref(data)), "capset")


def _drop_privileges(spec: dict[str, Any]) -> None:
    """For good: no_new_privs, no ambient or bounding capabilities, the sandbox's uid and
    gid without supplementary groups (as root), then an empty capability set."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    in_userns = spec["userns"] and spec.get("namespaces", True)
    if os.geteuid() == 0 or in_userns:
        _drop_bounding_set()  # needs CAP_SETPCAP: root's, or our user namespace's
    if os.geteuid() == 0 and not in_userns:
        uid, gid = spec["uid"], spec["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears the permitted and effective sets
    _clear_capabilities()


def _load_seccomp(fd: int) -> None:
    program = _read_all(fd)
    os.close(fd)
    if not program or len(program) % 8:
        raise SetupError("seccomp program is malformed")
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    rc = _libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0)
    _check(rc, "install the seccomp filter")


# -- the two processes ----------------------------------------------------------------------
def _child(spec: dict[str, Any], argv: list[str], env: dict[str, str], alive_fd: int) -> None:
    status_fd = spec.get("status_fd")
    try:
        os.setsid()  # no TIOCSTI into the caller's terminal
        if spec.get("info_fd") is not None:
            # The host's /proc is still mounted: /proc/self names us in the host's pid
            # namespace, which is what the driver needs to join our network namespace.
            host_pid = int(os.readlink("/proc/self"))
            os.write(spec["info_fd"], json.dumps({"child-pid": host_pid}).encode())
            os.close(spec["info_fd"])
        if spec.get("block_fd") is not None:
            os.read(spec["block_fd"], 1)
            os.close(spec["block_fd"])
        owner = None if spec["userns"] else (spec["uid"], spec["gid"])
        _build_root(spec, owner)
        if spec.get("hostname"):
            name = spec["hostname"].encode()
            _check(_libc.sethostname(name, len(name)), "sethostname")
        try:
            os.chdir(spec["chdir"])
        except OSError as exc:
            raise SetupError(f"chdir {spec['chdir']}: {exc.strerror}") from None
        _drop_privileges(spec)
        if spec.get("seccomp_fd") is not None:
            _load_seccomp(spec["seccomp_fd"])
        # Dying with the waiter: set after the last credential change (which clears it),
        # then make sure the waiter did not die before we asked.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.set_blocking(alive_fd, False)
        try:
            if os.read(alive_fd, 1) == b"":
                os._exit(EXIT_SETUP_FAILED)
        except BlockingIOError:
            pass
        os.close(alive_fd)
    except (SetupError, OSError) as exc:
        _fail(status_fd, str(exc))
        os._exit(EXIT_SETUP_FAILED)
    os._exit(_exec(["/bin/sh", "-c", INIT_SH, INIT_NAME, *argv], env, status_fd))


def _exec(argv: list[str], env: dict[str, str], status_fd: int | None) -> int:
    """execve the command; only returns (a shell's status) when that fails."""
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # closed by a successful exec: "ok"
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        _fail(None, f"{argv[0]}: command not found")
        return EXIT_NOT_FOUND
    except PermissionError:
        _fail(None, f"{argv[0]}: permission denied")
        return EXIT_NOT_EXECUTABLE
    except OSError as exc:
        _fail(None, f"{argv[0]}: {exc.strerror}")
        return EXIT_NOT_EXECUTABLE


def _fail(status_fd: int | None, message: str) -> None:
    line = f"devs-sandbox-nsinit: {message}\n".encode()
    if status_fd is not None:
        try:
            os.write(status_fd, line)
            return
        except OSError:
            pass
    try:
        os.write(2, line)
    except OSError:
        pass


def _waiter(child: int) -> int:
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return EXIT_SETUP_FAILED
        if os.WIFSIGNALED(status):
            return 128 + os.WTERMSIG(status)
        if os.WIFEXITED(status):
            return os.WEXITSTATUS(status)


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        os.write(2, b"usage: nsinit.py SPEC_FD -- COMMAND [ARG...]\n")
        return 2
    spec_fd = int(args[0])
    spec: dict[str, Any] = json.loads(_read_all(spec_fd))
    os.close(spec_fd)
    argv = args[2:]
    env_raw = _read_all(spec["env_fd"])
    os.close(spec["env_fd"])
    env = dict(item.split("=", 1) for item in env_raw.decode().split("\0") if item)
    status_fd = spec.get("status_fd")
    if not spec.get("namespaces", True):
        # No namespaces (the operator allowed it): still drop privileges and filter.
        try:
            _drop_privileges(spec)
            if spec.get("seccomp_fd") is not None:
                _load_seccomp(spec["seccomp_fd"])
        except (SetupError, OSError) as exc:
            _fail(status_fd, str(exc))
            return EXIT_SETUP_FAILED
        return _exec(argv, env, status_fd)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if spec.get("network_namespace", True):
        flags |= CLONE_NEWNET
    uid, gid = os.getuid(), os.getgid()
    try:
        if spec["userns"]:
            flags |= CLONE_NEWUSER
        _check(_libc.unshare(flags), "unshare")
        if spec["userns"]:
            _write_file("/proc/self/setgroups", "deny")
            _write_file("/proc/self/uid_map", f"{uid} {uid} 1\n")
            _write_file("/proc/self/gid_map", f"{gid} {gid} 1\n")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the driver, as --die-with-parent
    except (SetupError, OSError) as exc:
        _fail(status_fd, str(exc))
        return EXIT_SETUP_FAILED
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _child(spec, argv, env, alive_r)
        os._exit(EXIT_SETUP_FAILED)  # not reached: _child execs or exits
    os.close(alive_r)
    for key in ("seccomp_fd", "info_fd", "block_fd", "status_fd"):
        if spec.get(key) is not None:
            try:
                os.close(spec[key])
            except OSError:
                pass
    for op in spec["ops"]:
        if op.get("fd") is not None:
            try:
                os.close(op["fd"])
            except OSError:
                pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _waiter(pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The process driver: sandboxes made of host processes, layered with whatever the host offers.

Layers, each detected and reported (``SandboxContext.isolation``):
- ``rlimits`` always: RLIMIT_FSIZE, NOFILE, CORE=0; NPROC and AS only as fallbacks
  (RLIMIT_NPROC is per uid and ignored for root; RLIMIT_AS turns an OOM into a
  MemoryError and breaks runtimes that reserve address space);
- ``cgroup`` (v2 or v1) when writable: the memory and pids caps, CPU accounting,
  and the total kill;
- ``pid-namespace``, ``mount-namespace``, ``net-namespace`` through bubblewrap;
- ``tmpfs-workspace`` when root: the workspace's bytes and inodes capped by the kernel;
- ``unprivileged-user``: as root, each sandbox runs as a uid of its own.

How a command starts, without ``preexec_fn`` (unsafe with our watchdog threads):
Popen starts ``/bin/sh -c SHIM`` (as us, in a new session, with ``PATH`` only) and
the shim blocks on its stdin. Meanwhile the parent sets the shim's rlimits with
prlimit(2) (and on cgroup v2 moves it into the sandbox's cgroup), then says "go".
The shim moves itself into the v1 cgroups, then execs setpriv (drop to the sandbox
uid, no_new_privs), which execs bwrap (or the command); the command's environment
crosses only after the drop. Everything the command ever forks inherits the limits
and the cgroup: no window for a fork bomb to start outside them.

Invariant: ``destroy`` leaves no process, cgroup, mount, directory or lease, is
idempotent, works after a partial ``provision`` and after a crash (by id).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import resource
import selectors
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from devs_sandbox.base import Emit, OutputCallback, StartCallback
from devs_sandbox.capture import HeadTailCapture
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.errors import (
    DriverError,
    IsolationUnavailableError,
    ProvisionError,
    SandboxNotFoundError,
)
from devs_sandbox.isolation import (
    NOBODY_GID,
    NOBODY_UID,
    SANDBOX_UID_BASE,
    SANDBOX_UID_SPAN,
    HostSupport,
    bwrap,
    drop_privileges_argv,
    mounts,
    probe_host,
)
from devs_sandbox.isolation.cgroups import CgroupLimits, SandboxCgroup, list_sandbox_cgroups
from devs_sandbox.leases import LEASE_GRACE_S, Lease, LeaseRegistry, Owner
from devs_sandbox.models import (
    ENV_NAME,
    SANDBOX_ID_PATTERN,
    ExecResult,
    ResourceUsage,
    SandboxContext,
    SandboxMetrics,
    new_sandbox_id,
    validate_sandbox_id,
)
from devs_sandbox.runtimes import RUNTIME_BINARIES
from devs_sandbox.security.environment import EnvironmentSanitizer
from devs_sandbox.security.session_keys import Redactor, StreamRedactor, validate_secrets, wipe
from devs_sandbox.workspace import WorkspaceScanner

logger = logging.getLogger(__name__)

WORKSPACE_PREFIX: Final = "devs-sandbox-"
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The shim waits on its stdin (a pipe) for the parent to finish setting limits, then
# becomes the command. $0 is a label; $1 says whether the caller gave stdin (else the
# command gets /dev/null); the rest is the real argv. dash's read builtin takes one
# byte at a time from a pipe, so it never swallows the caller's data after "go".
# PWD is the only variable dash adds to the environment.
# $1: stdin given (1) or /dev/null (0); $2: how many cgroup v1 ``tasks`` files follow,
# into each of which the shim writes "0" (itself). Why the shim and not the parent: a
# parent writing a pid into cgroup.procs takes the global cgroup_threadgroup_rwsem for
# writing, which waits for an RCU grace period (10-25 ms here whenever the lock was idle,
# i.e. on most runs); a thread moving itself through ``tasks`` skips that lock
# (kernel/cgroup/cgroup.c, cgroup_procs_write_start). The shim is single-threaded, so
# its one thread is the whole process, and all it forks later inherits the cgroups.
SHIM: Final = (
    "read -r _ || exit 125; s=$1; n=$2; shift 2; "
    'while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n - 1)); done; '
    'unset PWD; if [ "$s" = 0 ]; then exec "$@" </dev/null; fi; exec "$@"'
)
SHIM_NAME: Final = "devs-sandbox-shim"
# The shim and setpriv run as root in the host's namespaces: they get this environment
# only. The command's own (which a task's config may fill with LD_PRELOAD or
# LD_LIBRARY_PATH pointing into its workspace) is handed over after the privilege drop:
# to bwrap through --args on a memfd, or to a second shim that sources it from a memfd.
PRIVILEGED_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
ENV_SHIM: Final = '. "/dev/fd/$1" || exit 125; shift; exec "$@"'
ENV_SHIM_NAME: Final = "devs-sandbox-env"
READ_CHUNK: Final = 65_536
EXIT_DRAIN_GRACE_S: Final = 0.2  # after exit, how long a grandchild may keep our pipes open
KILL_DRAIN_GRACE_S: Final = 0.5  # after a kill, how long to wait for pipes to close
SAMPLE_INTERVAL_S: Final = 0.05  # peak process count sampling while an exec runs
NO_PIDFD_POLL_S: Final = 0.01  # exit polling when the kernel has no pidfd (< 5.3)
MAX_SIGNAL: Final = 64
SECRETS_DIR_IN_BWRAP: Final = "/tmp/.devs-secrets"  # inside bwrap's private /tmp tmpfs
SECRETS_DIR_IN_WORKSPACE: Final = ".devs-secrets"  # fallback: in the workspace (tmpfs as root)

MECHANISMS: Final = (
    "rlimits",
    "cgroup",
    "pid-namespace",
    "mount-namespace",
    "net-namespace",
    "tmpfs-workspace",
    "unprivileged-user",
)


@dataclass
class _Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    config: SandboxLifecycleConfig
    workspace: Path
    uid: int
    gid: int
    isolation: tuple[str, ...]
    cgroup: SandboxCgroup | None = None
    mounted: bool = False
    bwrap_path: str | None = None
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    peak_processes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    scanner: WorkspaceScanner | None = None
    secrets: dict[str, bytearray] = field(default_factory=dict)
    redactor: Redactor | None = None
    leased: bool = False  # what this provision made, so a failed one undoes only that
    made_workspace: bool = False
    secret_paths: dict[str, str] = field(default_factory=dict)
    base_env: dict[str, str] | None = None  # computed once: host env is read at provision


def _exit_code_from_status(status: int) -> tuple[int, int | None]:
    """(shell-style exit code, killing signal or None)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    code = os.WEXITSTATUS(status)
    return code, None


def _signal_from_code(code: int, signaled: int | None, through_bwrap: bool) -> int | None:
    if signaled is not None:
        return signaled
    # bwrap reports a signalled command as 128 + N (as shells do).
    if through_bwrap and 128 < code <= 128 + MAX_SIGNAL:
        return code - 128
    return None


class ProcessDriver:
    """Runs sandboxes as host processes; see the module docstring for the layers."""

    name = "process"

    def __init__(
        self,
        *,
        leases: LeaseRegistry | None = None,
        workspace_root: Path | None = None,
        emit: Emit | None = None,
        host: HostSupport | None = None,
        host_env: Mapping[str, str] | None = None,
        sanitizer: EnvironmentSanitizer | None = None,
        lease_grace_s: float = LEASE_GRACE_S,
    ) -> None:
        self.leases = leases or LeaseRegistry()
        self.workspace_root = workspace_root or Path(tempfile.gettempdir())
        self._emit = emit
        self._host = host
        self._host_env = host_env
        self.sanitizer = sanitizer or EnvironmentSanitizer()
        self.lease_grace_s = lease_grace_s  # a lease-less leftover younger than this is spared
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()

    # -- host support ---------------------------------------------------------------
    @property
    def host(self) -> HostSupport:
        if self._host is None:
            self._host = probe_host()
        return self._host

    def _run_as(
        self, config: SandboxLifecycleConfig, sandbox_id: str | None = None
    ) -> tuple[int, int]:
        """The sandbox's (uid, gid). As root with "auto", a uid of its own per sandbox:
        with one shared uid, a sandbox without a mount namespace could read another's
        workspace and secrets, and signal its processes. ``sandbox_id`` None: any such uid
        (for reports)."""
        euid = os.geteuid()
        want = config.isolation.run_as_user
        if want == "current":
            return euid, os.getegid()
        if want == "nobody":
            return NOBODY_UID, NOBODY_GID
        if want == "auto":
            if euid != 0:
                return euid, os.getegid()
            uid = SANDBOX_UID_BASE if sandbox_id is None else self._sandbox_uid(sandbox_id)
            return uid, uid
        uid = int(want)
        if euid not in (uid, 0):
            raise IsolationUnavailableError(
                {"unprivileged-user": f"switching to uid {uid} needs root"}
            )
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
        return uid, gid

    def _sandbox_uid(self, sandbox_id: str) -> int:
        """Derived from the id, re-drawn while a live lease on this host holds the same."""
        taken = {
            lease.resources.get("uid")
            for _, lease in self.leases.all()
            if lease is not None and lease.sandbox_id != sandbox_id
        }
        for salt in range(64):
            digest = hashlib.sha256(f"{salt}:{sandbox_id}".encode()).digest()
            uid = SANDBOX_UID_BASE + int.from_bytes(digest[:8], "big") % SANDBOX_UID_SPAN
            if uid not in taken:
                return uid
        raise ProvisionError("no free sandbox uid (too many live sandboxes?)")

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" if it will be in effect for ``config``, else the reason why not."""
        host = self.host
        iso = config.isolation
        uid, _gid = self._run_as(config)
        report: dict[str, str] = dict.fromkeys(MECHANISMS, "")
        report["rlimits"] = host.rlimits[1]
        if not iso.use_cgroups:
            report["cgroup"] = "disabled by sandbox.isolation.useCgroups"
        elif not host.cgroup.available:
            report["cgroup"] = host.cgroup.reason
        bw = host.bwrap_for(uid)
        ns_reason = ""
        if not iso.use_bwrap:
            ns_reason = "disabled by sandbox.isolation.useBwrap"
        elif not bw.works:
            ns_reason = bw.reason
        for m in ("pid-namespace", "mount-namespace", "net-namespace"):
            report[m] = ns_reason
        if config.network and not ns_reason:
            report["net-namespace"] = "network requested (--network)"
        if not iso.tmpfs_workspace:
            report["tmpfs-workspace"] = "disabled by sandbox.isolation.tmpfsWorkspace"
        elif not host.tmpfs[0]:
            report["tmpfs-workspace"] = host.tmpfs[1]
        if uid == 0:
            report["unprivileged-user"] = "sandbox runs as root (isolation.runAsUser)"
        return report

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        """Runtimes on the sandbox's PATH (the host's binaries, seen read-only)."""
        del config  # every sandbox of this driver sees the same host binaries
        return frozenset(
            runtime
            for runtime, binaries in RUNTIME_BINARIES.items()
            if any(shutil.which(b, path=DEFAULT_PATH) for b in binaries)
        )

    @staticmethod
    def check_required(report: Mapping[str, str], required: Sequence[str]) -> None:
        missing = {m: report.get(m, "unknown mechanism") for m in required if report.get(m, "?")}
        if missing:
            raise IsolationUnavailableError(missing)

    # -- provision --------------------------------------------------------------------
    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """Create the sandbox. ``secrets`` (name -> value) reach it as files whose paths are
        in ``NAME_FILE``, never as argv or environment; they are redacted from its output."""
        sandbox_id = validate_sandbox_id(config.sandbox_id or new_sandbox_id())
        validate_secrets(secrets)
        report = self.isolation_report(config)
        self.check_required(report, config.isolation.required)
        uid, gid = self._run_as(config, sandbox_id)
        active = tuple(m for m, why in report.items() if not why)
        if "cgroup" in active:
            active = tuple(
                f"cgroup-v{self.host.cgroup.version}" if m == "cgroup" else m for m in active
            )
        workspace = self.workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
        box = _Box(sandbox_id, config, workspace, uid, gid, active)
        box.secrets = {name: bytearray(value) for name, value in (secrets or {}).items()}
        box.redactor = Redactor(box.secrets) if box.secrets else None
        with self._lock:
            if sandbox_id in self._boxes:
                raise ProvisionError(f"sandbox {sandbox_id} already exists")
            self._boxes[sandbox_id] = box
        try:
            self._provision(box, report)
        except BaseException as exc:
            # Undo what this call made, and only that: when the id is another live
            # sandbox's, its lease, cgroups and workspace are not ours to touch.
            self._undo(box)
            if isinstance(exc, ProvisionError | IsolationUnavailableError):
                raise
            if isinstance(exc, OSError | ValueError | DriverError):
                raise ProvisionError(f"cannot provision sandbox {sandbox_id}: {exc}") from exc
            raise
        labels = {"uid": str(uid)}
        if box.cgroup is not None:
            labels["cgroup"] = ",".join(str(p) for p in box.cgroup.paths)
        return SandboxContext(
            id=sandbox_id,
            driver=self.name,
            workspace=workspace,
            isolation=active,
            labels=labels,
        )

    def _undo(self, box: _Box) -> None:
        with self._lock:
            if self._boxes.get(box.id) is box:
                del self._boxes[box.id]
        left: list[str] = []
        if box.cgroup is not None:
            left += box.cgroup.remove()
        if box.mounted:
            try:
                mounts.unmount(box.workspace)
            except OSError as exc:
                left.append(str(exc))
        if box.made_workspace:
            left += _remove_tree(box.workspace)
        wipe(box.secrets.values())
        if box.leased:
            if left:
                logger.warning("sandbox %s: could not undo %s", box.id, "; ".join(left))
                self.leases.write(Lease(box.id, self.name, Owner(0, None, ""), str(box.workspace)))
            else:
                self.leases.remove(box.id)

    def _provision(self, box: _Box, report: Mapping[str, str]) -> None:
        cfg = box.config
        q = cfg.quotas
        # The lease comes first, so a crash at any later step leaves a findable orphan;
        # claimed, not overwritten, so a second provision of a live id fails here.
        lease = Lease(
            sandbox_id=box.id,
            driver=self.name,
            owner=Owner.current(),
            workspace=str(box.workspace),
            resources={"uid": box.uid},
        )
        if not self.leases.claim(lease):
            held = self.leases.read(box.id)
            if held is not None and held.owner.alive():
                raise ProvisionError(f"sandbox id {box.id} is in use by a live process")
            raise ProvisionError(
                f"sandbox id {box.id} was left behind by a dead process; "
                "run `devs-sandbox cleanup` and try again"
            )
        box.leased = True
        try:
            box.workspace.mkdir(mode=0o700)
        except FileExistsError:
            raise ProvisionError(
                f"workspace {box.workspace} already exists (sandbox id in use? "
                "run `devs-sandbox cleanup`)"
            ) from None
        box.made_workspace = True
        if not report["tmpfs-workspace"]:
            # +1: the tmpfs root directory takes an inode of its own.
            mounts.mount_tmpfs(
                box.workspace,
                mounts.TmpfsOptions(q.disk_bytes, q.file_count_limit + 1, box.uid, box.gid),
            )
            box.mounted = True
        elif box.uid != os.geteuid():
            os.chown(box.workspace, box.uid, box.gid)
        if not report["cgroup"]:
            limits = CgroupLimits(
                memory_bytes=q.memory_bytes,
                pids_max=q.process_count_limit,
                cpu_cores=q.cpu_cores,
            )
            cg = SandboxCgroup(
                self.host.cgroup, box.id, controllers=SandboxCgroup.controllers_for(limits)
            )
            box.cgroup = cg  # before create: a half-made cgroup is ours to undo (we hold the id)
            cg.create(limits)
        if not report["pid-namespace"]:
            box.bwrap_path = self.host.bwrap_for(box.uid).path
        if cfg.copy_in is not None:
            self._copy_in(box, cfg.copy_in)
        box.scanner = WorkspaceScanner(box.workspace, budget_s=q.depth_scan_budget_ms / 1000)
        if box.secrets:
            self._place_secrets(box)

    def _place_secrets(self, box: _Box) -> None:
        """With bwrap, each exec gets the secrets through pipes into its private /tmp (the host
        filesystem never holds them). Without, they are files in the workspace (a tmpfs as
        root), mode 0400, owned by the sandbox uid, removed with it."""
        if box.bwrap_path is not None:
            box.secret_paths = {n: f"{SECRETS_DIR_IN_BWRAP}/{n}" for n in box.secrets}
            return
        d = box.workspace / SECRETS_DIR_IN_WORKSPACE
        d.mkdir(mode=0o700)
        for name, value in box.secrets.items():
            path = d / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            try:
                os.write(fd, value)
            finally:
                os.close(fd)
            if box.uid != os.geteuid():
                os.chown(path, box.uid, box.gid)
            box.secret_paths[name] = str(path)
        d.chmod(0o500)
        if box.uid != os.geteuid():
            os.chown(d, box.uid, box.gid)

    def _copy_in(self, box: _Box, source: Path) -> None:
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

    # -- exec ---------------------------------------------------------------------------
    def _box(self, ctx: SandboxContext) -> _Box:
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            raise SandboxNotFoundError(ctx.id)
        return box

    def _env(self, box: _Box, extra: Mapping[str, str] | None) -> dict[str, str]:
        """The sandbox's whole environment: harmless host variables that pass the sanitizer
        (locale, terminal, time zone), our fixed ones, the secrets' paths, then the
        caller's explicit variables. Nothing else of the host's."""
        if box.base_env is None:
            host = self._host_env if self._host_env is not None else os.environ
            base = self.sanitizer.sanitize(host)
            base.setdefault("LANG", "C.UTF-8")
            base.setdefault("TERM", "dumb")
            base.update(
                {
                    "PATH": DEFAULT_PATH,
                    "HOME": str(box.workspace),
                    "TMPDIR": "/tmp",
                    "DEVS_SANDBOX_ID": box.id,
                }
            )
            for name, path in box.secret_paths.items():
                base[f"{name}_FILE"] = path
            base.update(box.config.env)
            box.base_env = base
        env = dict(box.base_env)
        if extra:
            env.update(extra)
        return env

    def _rlimits(self, box: _Box) -> list[tuple[int, int]]:
        q = box.config.quotas
        limits = [
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, q.max_open_files),
            (resource.RLIMIT_FSIZE, q.max_file_size_bytes),
        ]
        has_cgroup = box.cgroup is not None
        if q.address_space_bytes is not None:
            limits.append((resource.RLIMIT_AS, q.address_space_bytes))
        elif not has_cgroup:
            limits.append((resource.RLIMIT_AS, q.memory_bytes))
        if not has_cgroup:
            # Per uid, not per sandbox, and ignored for root: a last resort only.
            limits.append((resource.RLIMIT_NPROC, q.process_count_limit))
        return limits

    def _drop_argv(self, box: _Box) -> list[str]:
        if box.uid == os.geteuid():
            return []
        argv = drop_privileges_argv(box.uid, box.gid)
        if not argv:
            raise IsolationUnavailableError(
                {"unprivileged-user": "setpriv (util-linux) not found; cannot drop privileges"}
            )
        return argv

    def _argv(
        self,
        box: _Box,
        command: Sequence[str],
        secret_fds: Mapping[str, int] | None = None,
        args_fd: int | None = None,
    ) -> list[str]:
        if box.bwrap_path is None:
            return list(command)
        return bwrap.build_argv(
            box.bwrap_path,
            workspace=box.workspace,
            network=box.config.network,
            hide_paths=box.config.isolation.hide_paths,
            drop_caps=box.uid == 0,
            command=command,
            data_files={box.secret_paths[n]: fd for n, fd in (secret_fds or {}).items()},
            args_fd=args_fd,
        )

    def exec(
        self,
        ctx: SandboxContext,
        command: Sequence[str],
        *,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        max_output_bytes: int | None = None,
        on_start: StartCallback | None = None,
    ) -> ExecResult:
        if not command:
            raise ValueError("command must not be empty")
        box = self._box(ctx)
        for name, value in (env or {}).items():
            if not ENV_NAME.fullmatch(name) or "\0" in value:
                raise ValueError(f"invalid environment variable {name!r}")
        cap = box.config.max_output_bytes if max_output_bytes is None else max_output_bytes
        secret_fds = self._secret_pipes(box) if box.bwrap_path is not None else {}
        full_env = self._env(box, env)
        drop = self._drop_argv(box)
        env_fd: int | None = None
        popen_env = full_env
        try:
            if box.bwrap_path is not None:
                args = ["--clearenv"]
                for k, v in full_env.items():
                    args += ["--setenv", k, v]
                env_fd = _memfd("devs-sandbox-bwrap-args", b"\0".join(a.encode() for a in args))
                inner = self._argv(box, command, secret_fds, env_fd)
                popen_env = dict(PRIVILEGED_ENV)
            elif drop:
                lines = [f"export {k}={shlex.quote(v)}" for k, v in full_env.items()]
                lines.append("unset PWD")
                env_fd = _memfd("devs-sandbox-env", ("\n".join(lines) + "\n").encode())
                inner = ["/bin/sh", "-c", ENV_SHIM, ENV_SHIM_NAME, str(env_fd), *command]
                popen_env = dict(PRIVILEGED_ENV)
            else:
                inner = self._argv(box, command, secret_fds)
            self_join = box.cgroup.self_join_files() if box.cgroup is not None else []
            argv = [
                "/bin/sh",
                "-c",
                SHIM,
                SHIM_NAME,
                "0" if stdin is None else "1",
                str(len(self_join)),
                *self_join,
                *drop,
                *inner,
            ]
            pass_fds = (*secret_fds.values(), *(() if env_fd is None else (env_fd,)))
            return self._exec(
                box,
                argv,
                parent_joins_cgroup=box.cgroup is not None and not self_join,
                env=popen_env,
                pass_fds=pass_fds,
                secret_fds=secret_fds,
                cap=cap,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                stdin=stdin,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_start=on_start,
            )
        finally:
            for fd in (*secret_fds.values(), *(() if env_fd is None else (env_fd,))):
                with contextlib.suppress(OSError):
                    os.close(fd)

    @staticmethod
    def _secret_pipes(box: _Box) -> dict[str, int]:
        """One pipe per secret, already filled and closed for writing: bwrap copies it into a
        file of its private tmpfs (``--file``). The value never touches argv."""
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

    def _exec(
        self,
        box: _Box,
        argv: list[str],
        *,
        parent_joins_cgroup: bool,
        env: Mapping[str, str],
        pass_fds: tuple[int, ...],
        secret_fds: Mapping[str, int],
        cap: int,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        stdin: bytes | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_start: StartCallback | None,
    ) -> ExecResult:
        if box.cgroup is not None and box.cgroup.support.version == 1:
            # Per-exec peak: v1 lets us reset the high-water mark.
            mem = box.cgroup.dirs.get("memory")
            if mem is not None:
                with contextlib.suppress(OSError):
                    (mem / "memory.max_usage_in_bytes").write_text("0")
        cpu_before = box.cgroup.cpu_time_s() if box.cgroup is not None else None
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=box.workspace,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        except OSError as exc:
            raise DriverError(f"cannot start sandbox process: {exc}") from exc
        assert proc.stdin is not None
        with box.lock:
            box.procs[proc.pid] = proc
        try:
            try:
                for res, value in self._rlimits(box):
                    resource.prlimit(proc.pid, res, (value, value))
                if parent_joins_cgroup and box.cgroup is not None:
                    box.cgroup.add(proc.pid)  # v2: only the parent can move it
                os.write(proc.stdin.fileno(), b"go\n")
            except OSError as exc:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise DriverError(f"cannot confine sandbox process: {exc}") from exc
            if on_start is not None:
                try:
                    on_start(proc.pid)
                except Exception:
                    logger.exception("on_start callback failed")
            return self._communicate(
                box,
                proc,
                start=start,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                stdin=stdin,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                cap=cap,
                cpu_before=cpu_before,
            )
        finally:
            with box.lock:
                box.procs.pop(proc.pid, None)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _kill_exec(self, box: _Box, proc: subprocess.Popen[bytes]) -> None:
        # The leader's pid is the process group id (start_new_session); never getpgid()
        # after it may have been reaped.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if box.bwrap_path is None and box.cgroup is not None:
            # Without a pid namespace, a setsid grandchild is only reachable by cgroup.
            box.cgroup.kill_all()

    def _communicate(
        self,
        box: _Box,
        proc: subprocess.Popen[bytes],
        *,
        start: float,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        stdin: bytes | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        cap: int,
        cpu_before: float | None,
    ) -> ExecResult:
        assert proc.stdout is not None and proc.stderr is not None
        captures = {"out": HeadTailCapture(cap), "err": HeadTailCapture(cap)}
        callbacks = {"out": on_stdout, "err": on_stderr}
        # Secrets are redacted before anything keeps or forwards a byte of output.
        redactors: dict[str, StreamRedactor] = (
            {"out": box.redactor.stream(), "err": box.redactor.stream()} if box.redactor else {}
        )

        def deliver(tag: str, chunk: bytes) -> None:
            if not chunk:
                return
            captures[tag].feed(chunk)
            cb = callbacks[tag]
            if cb is not None:
                try:
                    cb(chunk)
                except Exception:
                    logger.exception("output callback failed")

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")
        open_streams = 2
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            pidfd = None
        stdin_view = memoryview(stdin) if stdin is not None else None
        if proc.stdin is not None:
            if stdin_view is not None and len(stdin_view):
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
            else:
                proc.stdin.close()
        deadline = None if timeout_s is None else start + timeout_s
        last_output = start
        exited_at: float | None = None
        killed_at: float | None = None
        timed_out = idle_timed_out = False
        next_sample = start + SAMPLE_INTERVAL_S
        status: int | None = None
        rusage: resource.struct_rusage | None = None

        def reap(block: bool) -> bool:
            nonlocal status, rusage
            if status is not None:
                return True
            try:
                pid, st, ru = os.wait4(proc.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                status = 0
                return True
            if pid == 0:
                return False
            status, rusage = st, ru
            proc.returncode = os.waitstatus_to_exitcode(st)
            return True

        try:
            while True:
                now = time.monotonic()
                if exited_at is None and (pidfd is None or killed_at is not None) and reap(False):
                    exited_at = now
                if exited_at is not None and open_streams == 0:
                    break
                if exited_at is not None and now - exited_at > EXIT_DRAIN_GRACE_S:
                    break  # a grandchild holds the pipes; the command itself is done
                if killed_at is not None and now - killed_at > KILL_DRAIN_GRACE_S:
                    break
                if killed_at is None:
                    if deadline is not None and now >= deadline:
                        timed_out = True
                    elif idle_timeout_s is not None and now - last_output >= idle_timeout_s:
                        idle_timed_out = True
                    if timed_out or idle_timed_out:
                        self._kill_exec(box, proc)
                        killed_at = now
                        continue
                if now >= next_sample:
                    self._sample_processes(box, proc)
                    next_sample = now + SAMPLE_INTERVAL_S
                waits = [next_sample - now]
                if killed_at is None:
                    if deadline is not None:
                        waits.append(deadline - now)
                    if idle_timeout_s is not None:
                        waits.append(last_output + idle_timeout_s - now)
                if pidfd is None or killed_at is not None:
                    waits.append(NO_PIDFD_POLL_S)
                if exited_at is not None:
                    waits.append(exited_at + EXIT_DRAIN_GRACE_S - now)
                for key, _mask in sel.select(max(0.0, min(waits))):
                    tag = key.data
                    if tag == "exit":
                        sel.unregister(key.fd)
                        reap(True)
                        exited_at = time.monotonic()
                    elif tag == "in":
                        assert stdin_view is not None and proc.stdin is not None
                        try:
                            n = os.write(key.fd, stdin_view[:READ_CHUNK])
                            stdin_view = stdin_view[n:]
                        except BlockingIOError:
                            continue
                        except (BrokenPipeError, OSError):
                            stdin_view = stdin_view[:0]
                        if not len(stdin_view):
                            sel.unregister(key.fd)
                            with contextlib.suppress(OSError):
                                proc.stdin.close()
                    else:
                        try:
                            chunk = os.read(key.fd, READ_CHUNK)
                        except OSError:
                            chunk = b""
                        if not chunk:
                            sel.unregister(key.fd)
                            open_streams -= 1
                            continue
                        last_output = time.monotonic()
                        red = redactors.get(tag)
                        deliver(tag, red.feed(chunk) if red else chunk)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            if status is None and not reap(False):
                self._kill_exec(box, proc)
                reap(True)
        for tag, red in redactors.items():
            deliver(tag, red.flush())
        end = time.monotonic()
        assert status is not None
        code, signaled = _exit_code_from_status(status)
        sig = _signal_from_code(code, signaled, box.bwrap_path is not None)
        self._sample_processes(box, proc)
        return ExecResult(
            exit_code=code,
            stdout=captures["out"].result(),
            stderr=captures["err"].result(),
            duration_s=end - start,
            timed_out=timed_out,
            idle_timed_out=idle_timed_out,
            signal=sig,
            resources=self._usage(box, rusage, end - start, cpu_before),
        )

    def _sample_processes(self, box: _Box, proc: subprocess.Popen[bytes]) -> None:
        n: int | None = None
        if box.cgroup is not None:
            n = box.cgroup.pids_current()
        if n is None:
            n = _count_session(proc.pid)
        if n is not None and n > box.peak_processes:
            box.peak_processes = n

    def _usage(
        self,
        box: _Box,
        rusage: resource.struct_rusage | None,
        wall_s: float,
        cpu_before: float | None,
    ) -> ResourceUsage:
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
            # Through bwrap's pid namespace, what its init reaps never reaches our rusage:
            # an honest "unknown" beats a number that misses the whole task.
            if cpu is None and box.bwrap_path is None:
                cpu = rusage.ru_utime + rusage.ru_stime
            if peak_mem is None:
                peak_mem = rusage.ru_maxrss * 1024  # Linux reports KiB
        # The shim and bwrap count as processes of the sandbox while they run.
        peak = max(box.peak_processes, 1)
        return ResourceUsage(
            cpu_time_s=cpu, peak_memory_bytes=peak_mem, peak_processes=peak, wall_time_s=wall_s
        )

    # -- observe / stop ---------------------------------------------------------------
    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        box = self._box(ctx)
        counters = box.cgroup.counters() if box.cgroup is not None else None
        procs = counters.pids_current if counters is not None else None
        if procs is None:
            with box.lock:
                leaders = list(box.procs)
            procs = sum(_count_session(pid) or 0 for pid in leaders)
        box.peak_processes = max(box.peak_processes, procs)
        file_count: int | None = None
        disk: int | None = None
        inodes_free: int | None = None
        disk_free: int | None = None
        if box.mounted:
            # One statvfs gives count, bytes and headroom of our own tmpfs.
            with contextlib.suppress(OSError):
                st = os.statvfs(box.workspace)
                file_count = max(0, st.f_files - st.f_ffree - 1)  # minus the tmpfs root
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
            running=self._running(box),
        )

    def member_pids(self, ctx: SandboxContext) -> list[int]:
        """Every process of the sandbox (its cgroup); empty without a cgroup. Observers
        such as run_shell_monitored add these to the exec's ppid tree."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None or box.cgroup is None:
            return []
        return box.cgroup.pids()

    def _running(self, box: _Box) -> bool:
        if box.cgroup is not None:
            current = box.cgroup.pids_current()
            if current is not None:
                return current > 0
            if box.cgroup.pids():
                return True
        with box.lock:
            return any(p.poll() is None for p in box.procs.values())

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            box = self._boxes.get(ctx.id)
        return box is not None and self._running(box)

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every process of the sandbox; the workspace stays until ``destroy``."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            return
        with box.lock:
            leaders = list(box.procs)
        for pid in leaders:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if box.cgroup is not None:
            box.cgroup.kill_all()

    # -- destroy --------------------------------------------------------------------------
    def destroy(self, ctx: SandboxContext) -> None:
        with self._lock:
            box = self._boxes.pop(ctx.id, None)
        if box is not None:
            with box.lock:
                procs = list(box.procs.values())
            for p in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            wipe(box.secrets.values())
            box.secrets.clear()
        leftovers = self._destroy_resources(
            ctx.id, ctx.workspace, box.cgroup if box is not None else None
        )
        if leftovers:
            logger.warning("sandbox %s: could not remove %s", ctx.id, "; ".join(leftovers))
            # Keep the lease but hand it to nobody, so the next reaper retries.
            self.leases.write(Lease(ctx.id, self.name, Owner(0, None, ""), str(ctx.workspace)))
        else:
            self.leases.remove(ctx.id)

    def _destroy_resources(
        self, sandbox_id: str, workspace: Path, cgroup: SandboxCgroup | None = None
    ) -> list[str]:
        """Remove by id whatever exists; ``cgroup`` narrows the search when we know it."""
        left: list[str] = []
        support = self.host.cgroup
        if cgroup is not None:
            left += cgroup.remove()
        elif support.available:
            left += SandboxCgroup.from_paths(support, sandbox_id).remove()
        if workspace.exists() or workspace.is_symlink():
            # Only root can have mounted it; umount2 on a plain directory is a cheap EINVAL,
            # cheaper than scanning /proc/self/mountinfo.
            if os.geteuid() == 0 and not workspace.is_symlink():
                try:
                    mounts.unmount(workspace)
                except OSError as exc:
                    left.append(str(exc))
            left += _remove_tree(workspace)
        return left

    def reap_orphans(self) -> list[str]:
        """Destroy sandboxes whose owner died; also lease-less leftovers past the grace.

        Ids come from file names in shared directories, so each is validated before it
        becomes a path (a directory named ``devs-sandbox-..`` must not make the root cgroup
        a "sandbox"), and one bad entry never stops the rest.
        """
        reaped: list[str] = []
        for sandbox_id, lease in self.leases.orphans():
            if lease is not None and lease.driver != self.name:
                continue
            if not SANDBOX_ID_PATTERN.fullmatch(sandbox_id) or sandbox_id in {".", ".."}:
                continue
            workspace = self.workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
            if lease is not None and Path(lease.workspace) != workspace:
                workspace = Path(lease.workspace)
                if not workspace.name.startswith(WORKSPACE_PREFIX):
                    continue  # a lease naming a path that is not a workspace: leave it
            try:
                if not self._destroy_resources(sandbox_id, workspace):
                    self.leases.remove(sandbox_id)
                    reaped.append(sandbox_id)
            except Exception:
                logger.exception("reaping orphan sandbox %s failed", sandbox_id)
        # Lease-less leftovers (a lease lost to a full disk, an older version): taken only
        # when old AND idle. A live sandbox is never young-and-leaseless (its lease is
        # written first), and one whose lease we cannot see still has processes or recent
        # changes while it works.
        leased = {sid for sid, _ in self.leases.all()}
        with self._lock:
            mine = set(self._boxes)
        now = time.time()
        candidates: set[str] = set()
        if self.host.cgroup.available:
            candidates |= list_sandbox_cgroups(self.host.cgroup)
        with contextlib.suppress(OSError):
            for p in self.workspace_root.iterdir():
                if p.name.startswith(WORKSPACE_PREFIX) and p.is_dir() and not p.is_symlink():
                    candidates.add(p.name[len(WORKSPACE_PREFIX) :])
        for sandbox_id in sorted(candidates - leased - mine):
            if not SANDBOX_ID_PATTERN.fullmatch(sandbox_id) or sandbox_id in {".", ".."}:
                continue
            workspace = self.workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
            cg = (
                SandboxCgroup.from_paths(self.host.cgroup, sandbox_id)
                if self.host.cgroup.available
                else None
            )
            paths = [workspace, *(cg.paths if cg is not None else [])]
            if min(_age_s(p, now) for p in paths) < self.lease_grace_s:
                continue
            if cg is not None and cg.exists() and cg.pids():
                continue  # processes run in it: somebody's live sandbox, lease or not
            try:
                if not self._destroy_resources(sandbox_id, workspace):
                    reaped.append(sandbox_id)
            except Exception:
                logger.exception("reaping leftover sandbox %s failed", sandbox_id)
        return reaped


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, read from offset 0 by the child
    (never on disk, no size limit, nothing blocks the way a full pipe would)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _age_s(path: Path, now: float) -> float:
    """Seconds since ``path`` last changed; a missing path is infinitely old."""
    try:
        st = path.lstat()
    except OSError:
        return float("inf")
    return now - max(st.st_mtime, st.st_ctime)


def _remove_tree(path: Path) -> list[str]:
    """rmtree that never follows a symlink and, as root, never chmods a path: in the
    world-writable temp directory a local user may swap entries while we work."""
    errors: list[str] = []
    as_root = os.geteuid() == 0

    def onexc(_func: object, p: str, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            return  # a concurrent destroy (two reapers) got there first
        if as_root or Path(p) == path:
            errors.append(f"{p}: {getattr(exc, 'strerror', None) or exc}")
            return
        # Not root: a task may leave a directory mode 000 inside the tree; as its owner we
        # may open it up and retry (never the workspace's parent, the shared /tmp).
        try:
            Path(p).parent.chmod(0o700)
            if Path(p).is_dir() and not Path(p).is_symlink():
                Path(p).chmod(0o700)
                shutil.rmtree(p)
            else:
                Path(p).unlink()
        except FileNotFoundError:
            pass
        except OSError as again:
            errors.append(f"{p}: {again.strerror or exc}")

    try:
        if path.is_symlink():
            path.unlink()
            return errors
        try:
            path.rmdir()  # the usual case: an unmounted tmpfs leaves an empty directory
        except OSError:
            shutil.rmtree(path, onerror=lambda f, p, e: onexc(f, p, e[1]))
    except OSError as exc:  # e.g. swapped for a file between our checks
        errors.append(f"{path}: {exc}")
    if path.exists() or path.is_symlink():
        errors.append(f"{path}: still present")
    return errors


def _count_session(sid: int) -> int | None:
    """Processes in session ``sid`` (the exec's leader); the no-cgroup fallback count."""
    try:
        import psutil  # noqa: PLC0415 - only needed on hosts without a pids cgroup
    except ImportError:
        return None
    n = 0
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                n += 1
    return n

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
import fcntl
import hashlib
import json
import logging
import os
import pwd
import resource
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers import exec_io
from devs_sandbox.errors import (
    DriverError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    SandboxNotFoundError,
    WeakerIsolationError,
)
from devs_sandbox.isolation import (
    NOBODY_GID,
    NOBODY_UID,
    SANDBOX_UID_BASE,
    SANDBOX_UID_SPAN,
    HostSupport,
    bwrap,
    drop_privileges_argv,
    layout,
    mounts,
    probe_host,
    unshare,
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
from devs_sandbox.security.session_keys import Redactor, validate_secrets, wipe
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
MAX_SIGNAL: Final = 64
TUN_DEVICE: Final = "/dev/net/tun"
NS_GET_USERNS: Final = 0xB701  # ioctl_ns(2): the user namespace owning a namespace
SECRETS_DIR_IN_WORKSPACE: Final = ".devs-secrets"  # without namespaces: in the workspace
NETWORK_SETUP_TIMEOUT_S: Final = 10.0  # bwrap reports its pid in ms; pasta starts in ~35 ms
PASTA_STOP_GRACE_S: Final = 1.0  # pasta exits at once on SIGTERM; then SIGKILL

MECHANISMS: Final = (
    "rlimits",
    "cgroup",
    "pid-namespace",
    "mount-namespace",
    "net-namespace",
    "seccomp",
    "tmpfs-workspace",
    "unprivileged-user",
)
NAMESPACES: Final = ("pid-namespace", "mount-namespace", "net-namespace")
# What a default run promises (host read-only with private /tmp, no network or an isolated
# one, kernel surfaces filtered): provided by bwrap or by our unshare launcher, or the run
# is refused unless the operator allowed weaker isolation.
PROMISED: Final = (*NAMESPACES, "seccomp")


@dataclass(frozen=True, slots=True)
class _Plan:
    report: dict[str, str]
    launcher: str | None
    bwrap_path: str | None
    network: str

    def warnings(self) -> tuple[str, ...]:
        """One entry per default layer not in effect, with the reason."""
        out = [f"{m}: {why}" for m, why in self.report.items() if why]
        if self.network == "host":
            out.append("network: the sandbox shares the host's network namespace")
        return tuple(out)


@dataclass
class _Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    config: SandboxLifecycleConfig
    workspace: Path
    uid: int
    gid: int
    isolation: tuple[str, ...]
    root: Path = field(default=Path())  # the sandbox's private root: workspace, tmp, shm
    cgroup: SandboxCgroup | None = None
    mounted: bool = False
    launcher: str | None = None  # "bwrap", "unshare", or None without namespaces
    bwrap_path: str | None = None
    network: str = "none"  # "none" (own namespace, no route), "pasta", or "host"
    base_inodes: int = 0  # inodes of the root's structure, not counted as the task's
    secrets_placed: bool = False  # written once into the tmpfs root (else per exec)
    warnings: tuple[str, ...] = ()
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

    def _plan(self, config: SandboxLifecycleConfig, uid: int) -> _Plan:
        """Which mechanism provides each layer for ``config`` here, and why a layer is not."""
        host = self.host
        iso = config.isolation
        report: dict[str, str] = dict.fromkeys(MECHANISMS, "")
        report["rlimits"] = host.rlimits[1]
        if not iso.use_cgroups:
            report["cgroup"] = "disabled by sandbox.isolation.useCgroups"
        elif not host.cgroup.available:
            report["cgroup"] = host.cgroup.reason
        launcher: str | None = None
        bwrap_path: str | None = None
        ns_reason = ""
        if not iso.namespaces:
            ns_reason = "disabled by sandbox.isolation.namespaces"
        else:
            why: list[str] = []
            if iso.use_bwrap:
                bw = host.bwrap_for(uid)
                if bw.works:
                    launcher, bwrap_path = "bwrap", bw.path
                else:
                    why.append(bw.reason)
            else:
                why.append("bwrap disabled by sandbox.isolation.useBwrap")
            if launcher is None:
                ok, reason = host.nsinit_for(uid)
                if ok:
                    launcher = "unshare"
                else:
                    why.append(reason)
            if launcher is None:
                ns_reason = "; ".join(why)
        for m in NAMESPACES:
            report[m] = ns_reason
        network = "none"
        if config.network:
            if launcher is None:
                network = "host"
            elif host.pasta is None:
                network = "host"
                report["net-namespace"] = (
                    "--network needs pasta to keep the sandbox off the host's loopback "
                    "(apt-get install passt)"
                )
            elif not os.access(TUN_DEVICE, os.R_OK | os.W_OK):
                network = "host"
                report["net-namespace"] = (
                    f"--network needs pasta, which cannot open {TUN_DEVICE} as this user "
                    "(run as root, or make it mode 0666 as most distributions do)"
                )
            else:
                network = "pasta"
        if not iso.seccomp:
            report["seccomp"] = "disabled by sandbox.isolation.seccomp"
        else:
            report["seccomp"] = host.seccomp[1]
        if not iso.tmpfs_workspace:
            report["tmpfs-workspace"] = "disabled by sandbox.isolation.tmpfsWorkspace"
        elif not host.tmpfs[0]:
            report["tmpfs-workspace"] = host.tmpfs[1]
        if uid == 0:
            report["unprivileged-user"] = "sandbox runs as root (isolation.runAsUser)"
        return _Plan(report, launcher, bwrap_path, network)

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" if it will be in effect for ``config``, else the reason why not."""
        uid, _gid = self._run_as(config)
        return self._plan(config, uid).report

    def namespace_launcher(self, config: SandboxLifecycleConfig) -> str | None:
        """ "bwrap" or "unshare": what gives ``config`` its namespaces here; None: nothing."""
        uid, _gid = self._run_as(config)
        return self._plan(config, uid).launcher

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
        uid, gid = self._run_as(config, sandbox_id)
        plan = self._plan(config, uid)
        report = plan.report
        self.check_required(report, config.isolation.required)
        missing = {m: report[m] for m in PROMISED if report[m]}
        if plan.network == "host" and config.network:
            missing.setdefault("net-namespace", "network requested without a namespace")
        if missing and not config.isolation.allow_weaker_isolation:
            raise WeakerIsolationError(missing)
        active = tuple(m for m, why in report.items() if not why)
        if "cgroup" in active:
            active = tuple(
                f"cgroup-v{self.host.cgroup.version}" if m == "cgroup" else m for m in active
            )
        if plan.network == "pasta":
            active += ("network-pasta",)
        root = self.workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
        workspace = root / layout.WORKSPACE_DIR
        box = _Box(sandbox_id, config, workspace, uid, gid, active, root=root)
        box.launcher, box.bwrap_path, box.network = plan.launcher, plan.bwrap_path, plan.network
        box.warnings = plan.warnings()
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
        labels = {"uid": str(uid), "namespaces": plan.launcher or "none"}
        if box.cgroup is not None:
            labels["cgroup"] = ",".join(str(p) for p in box.cgroup.paths)
        return SandboxContext(
            id=sandbox_id,
            driver=self.name,
            workspace=workspace,
            isolation=active,
            labels=labels,
            warnings=box.warnings,
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
                mounts.unmount(box.root)
            except OSError as exc:
                left.append(str(exc))
        if box.made_workspace:
            left += _remove_tree(box.root)
        wipe(box.secrets.values())
        if box.leased:
            if left:
                logger.warning("sandbox %s: could not undo %s", box.id, "; ".join(left))
                self.leases.write(Lease(box.id, self.name, Owner(0, None, ""), str(box.root)))
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
            workspace=str(box.root),
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
            box.root.mkdir(mode=0o700)
        except FileExistsError:
            raise ProvisionError(
                f"sandbox directory {box.root} already exists (sandbox id in use? "
                "run `devs-sandbox cleanup`)"
            ) from None
        box.made_workspace = True
        if not report["tmpfs-workspace"]:
            # One tmpfs holds everything the task can write (workspace, /tmp, /var/tmp,
            # /dev/shm): its size is the disk quota, its inodes the file quota.
            mounts.mount_tmpfs(
                box.root,
                # The root and its structure take inodes of their own: the file quota
                # counts only what the task makes.
                mounts.TmpfsOptions(
                    q.disk_bytes,
                    q.file_count_limit + 1 + len(self._structure(box)) + len(box.secrets),
                    box.uid,
                    box.gid,
                ),
            )
            box.mounted = True
        elif box.uid != os.geteuid():
            os.chown(box.root, box.uid, box.gid)
        self._make_areas(box)
        if box.secrets and box.launcher is not None:
            self._place_secrets(box)  # in the sandbox's /tmp: counted as structure
        if box.mounted:
            with contextlib.suppress(OSError):
                st = os.statvfs(box.root)
                box.base_inodes = st.f_files - st.f_ffree
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
        if cfg.copy_in is not None:
            self._copy_in(box, cfg.copy_in)
        areas = layout.sandbox_areas(box.root)
        box.scanner = WorkspaceScanner(
            box.root,
            walk_roots=[areas["workspace"], *(areas[n] for n in layout.TMP_DIRS.values())],
            budget_s=q.depth_scan_budget_ms / 1000,
        )
        if box.secrets and box.launcher is None:
            self._place_secrets(box)  # after copy-in: a repository cannot plant over them

    @staticmethod
    def _structure(box: _Box) -> list[tuple[Path, int, bool]]:
        """Directories under the sandbox root, in creation order: (path, mode, owned by
        the sandbox). The workspace (0700) and the sandbox's /tmp, /var/tmp and /dev/shm
        (1777, as those are); with namespaces, the mount points a launcher needs inside
        them (ours: the task cannot remove or swap them)."""
        areas = layout.sandbox_areas(box.root)
        out = [
            (path, 0o700 if name == "workspace" else 0o1777, True) for name, path in areas.items()
        ]
        if box.launcher is None:
            return out
        for dest, area in layout.TMP_DIRS.items():
            rel = _relative_to(box.workspace, Path(dest))
            if rel is not None:
                for i in range(1, len(rel.parts) + 1):
                    out.append((box.root / area / Path(*rel.parts[:i]), 0o755, False))
        out.append((box.root / "tmp" / Path(layout.SECRETS_DIR).name, 0o500, False))
        return out

    def _make_areas(self, box: _Box) -> None:
        chown = box.uid != os.geteuid()
        for path, mode, owned in self._structure(box):
            path.mkdir(mode=mode)
            path.chmod(mode)  # mkdir's mode passes through the umask
            if owned and chown:
                os.chown(path, box.uid, box.gid)

    def _place_secrets(self, box: _Box) -> None:
        """Secrets as files, mode 0400, owned by the sandbox uid, never on a disk. In a
        namespaced sandbox whose root is a tmpfs (as root) they are written once into its
        /tmp/.devs-secrets; whose root is a plain directory (unprivileged), each exec gets
        them through pipes onto a tmpfs of its own. Without namespaces they are files in
        the workspace (a tmpfs as root), removed with it."""
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

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        box = self._box(ctx)
        for name in request.env:
            if not ENV_NAME.fullmatch(name):  # exported through a shell or --setenv
                raise ValueError(f"invalid environment variable {name!r}")
        cwd = box.workspace if request.cwd is None else box.workspace / request.cwd
        cap = (
            box.config.max_output_bytes
            if request.max_output_bytes is None
            else request.max_output_bytes
        )
        launch = _Launch()
        try:
            self._prepare_launch(box, request.argv, self._env(box, request.env), launch, cwd)
            self_join = box.cgroup.self_join_files() if box.cgroup is not None else []
            argv = [
                "/bin/sh",
                "-c",
                SHIM,
                SHIM_NAME,
                "0" if request.stdin is None else "1",
                str(len(self_join)),
                *self_join,
                *launch.argv,
            ]
            return self._exec(
                box,
                argv,
                request,
                parent_joins_cgroup=box.cgroup is not None and not self_join,
                launch=launch,
                cap=cap,
                cwd=cwd,
            )
        finally:
            launch.close()
            for pidfd in launch.pasta_pidfds:
                _stop_pasta(pidfd)

    def _prepare_launch(
        self,
        box: _Box,
        command: Sequence[str],
        full_env: dict[str, str],
        launch: _Launch,
        cwd: Path,
    ) -> None:
        """The argv after the shim, its environment and the fds it inherits: bwrap or our
        unshare launcher with the sandbox's layout, seccomp program and (for pasta) the
        handshake pipes; without namespaces, the privilege drop and the filter only."""
        wants_seccomp = "seccomp" in box.isolation
        if box.launcher is None and not wants_seccomp:
            drop = self._drop_argv(box)
            if drop:
                lines = [f"export {k}={shlex.quote(v)}" for k, v in full_env.items()]
                lines.append("unset PWD")
                env_fd = launch.child(
                    unshare.memfd("devs-sandbox-env", ("\n".join(lines) + "\n").encode())
                )
                launch.argv = [*drop, "/bin/sh", "-c", ENV_SHIM, ENV_SHIM_NAME, str(env_fd)]
                launch.argv += command
                launch.env = dict(PRIVILEGED_ENV)
            else:
                launch.argv, launch.env = list(command), full_env
            return
        seccomp_fd: int | None = None
        if wants_seccomp:
            from devs_sandbox.isolation import seccomp  # noqa: PLC0415 - imports libseccomp

            program = seccomp.build_bpf(seccomp.Profile(pid_namespace=box.launcher is not None))
            seccomp_fd = launch.child(unshare.memfd("devs-sandbox-seccomp", program))
        lay: layout.Layout | None = None
        if box.launcher is not None:
            secret_fds = (
                {}
                if box.secrets_placed
                else {n: launch.child(fd) for n, fd in self._secret_pipes(box).items()}
            )
            lay = layout.build(
                root=box.root,
                hide_paths=box.config.isolation.hide_paths,
                cgroup_dirs=box.cgroup.dirs if box.cgroup is not None else None,
                secret_fds=secret_fds,
                hide_state=box.uid == 0,
                chdir=cwd,
            )
        info_w = block_r = None
        if box.network == "pasta":
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            launch.info_r, launch.block_w = launch.parent(info_r), launch.parent(block_w)
            launch.child(info_w)
            launch.child(block_r)
        launch.env = dict(PRIVILEGED_ENV)
        if box.launcher == "bwrap":
            assert box.bwrap_path is not None and lay is not None
            args = ["--clearenv"]
            for k, v in full_env.items():
                args += ["--setenv", k, v]
            args_fd = launch.child(
                unshare.memfd("devs-sandbox-bwrap-args", b"\0".join(a.encode() for a in args))
            )
            launch.argv = [
                *self._drop_argv(box),
                *bwrap.render(
                    box.bwrap_path,
                    lay,
                    command=command,
                    network_namespace=box.network != "host",
                    user_namespace=box.uid != 0,
                    drop_caps=box.uid == 0,
                    seccomp_fd=seccomp_fd,
                    args_fd=args_fd,
                    info_fd=info_w,
                    block_fd=block_r,
                ),
            ]
            return
        # Our unshare launcher (or, without namespaces, its drop-and-filter mode): it drops
        # privileges itself, after the mounts that need them.
        status_r, status_w = os.pipe()
        launch.status_r = launch.parent(status_r)
        launch.child(status_w)
        env_fd = launch.child(unshare.memfd("devs-sandbox-env", unshare.env_blob(full_env)))
        spec = unshare.spec(
            lay,
            userns=os.geteuid() != 0,
            uid=box.uid,
            gid=box.gid,
            env_fd=env_fd,
            seccomp_fd=seccomp_fd,
            status_fd=status_w,
            network_namespace=box.network != "host",
            info_fd=info_w,
            block_fd=block_r,
        )
        spec_fd = launch.child(unshare.memfd("devs-sandbox-nsinit", json.dumps(spec).encode()))
        launch.argv = unshare.argv(spec_fd, command)

    def _after_go(self, box: _Box, proc: subprocess.Popen[bytes], launch: _Launch) -> None:
        """Between the shim's "go" and the command: connect pasta to the sandbox's network
        namespace, then wait for the launcher to report that the command was exec'd."""
        launch.close_child_ends()
        deadline = time.monotonic() + NETWORK_SETUP_TIMEOUT_S
        if launch.info_r is not None and launch.block_w is not None:
            child_pid = _read_child_pid(launch.info_r, deadline, proc)
            launch.pasta_pidfds.append(self._start_pasta(box, child_pid, deadline))
            os.write(launch.block_w, b"1")
        if launch.status_r is not None:
            why = _read_until_eof(launch.status_r, deadline)
            if why:
                raise DriverError(f"cannot start sandbox: {why.decode(errors='replace').strip()}")

    def _start_pasta(self, box: _Box, child_pid: int, deadline: float) -> int:
        """Give the sandbox's network namespace user-mode outbound networking: pasta with
        no port forwarding either way and the gateway not mapped to the host (so the host's
        127.0.0.1 and its abstract sockets stay out of reach), in the sandbox's cgroup.
        Returns a pidfd of pasta's daemon, which the exec stops when it ends."""
        pasta = self.host.pasta
        assert pasta is not None
        netns = f"/proc/{child_pid}/ns/net"
        fds: list[int] = []
        try:
            ns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(ns_fd)
            owner_fd = fcntl.ioctl(ns_fd, NS_GET_USERNS)
            fds.append(owner_fd)
            pid_fd = unshare.memfd("devs-sandbox-pasta-pid", b"")
            fds.append(pid_fd)
            argv = [
                pasta,
                "--quiet",
                "--config-net",
                "--no-map-gw",
                *("-t", "none", "-u", "none", "-T", "none", "-U", "none"),
                "-P",
                f"/proc/self/fd/{pid_fd}",
            ]
            if os.geteuid() == 0:
                # /dev/net/tun is often root-only: pasta keeps root but drops to the
                # capabilities it needs, in namespaces and a seccomp filter of its own.
                argv += ["--runas", "0:0"]
            if os.fstat(owner_fd).st_ino != Path("/proc/self/ns/user").stat().st_ino:
                argv += ["--userns", f"/proc/self/fd/{owner_fd}"]
            # Opened by us, passed as fds: pasta, having dropped most capabilities, could not
            # open /proc/<pid>/ns/* of a process with more of them than it has (ptrace
            # access rules). It cannot watch an fd path, so the exec stops it explicitly.
            argv += ["--netns", f"/proc/self/fd/{ns_fd}"]
            self_join = box.cgroup.self_join_files() if box.cgroup is not None else []
            shim = ["/bin/sh", "-c", SHIM, SHIM_NAME, "1", str(len(self_join)), *self_join]
            # Its messages go to a memfd: the daemon keeps the descriptor, so a pipe would
            # never reach EOF.
            err_fd = unshare.memfd("devs-sandbox-pasta-err", b"")
            fds.append(err_fd)
            proc = subprocess.Popen(
                [*shim, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err_fd,
                env=dict(PRIVILEGED_ENV),
                pass_fds=(ns_fd, owner_fd, pid_fd),
                close_fds=True,
                cwd="/",
            )
            assert proc.stdin is not None
            try:
                if box.cgroup is not None and not self_join:
                    box.cgroup.add(proc.pid)
                proc.stdin.write(b"go\n")
                proc.stdin.close()
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            if proc.returncode != 0:
                os.lseek(err_fd, 0, os.SEEK_SET)
                err = os.read(err_fd, 65536).decode(errors="replace")
                lines = [ln for ln in err.splitlines() if ln.strip() and "syslog" not in ln]
                raise DriverError(f"pasta failed: {lines[-1] if lines else proc.returncode}")
            os.lseek(pid_fd, 0, os.SEEK_SET)
            daemon = int(os.read(pid_fd, 64).decode().strip())
            return os.pidfd_open(daemon)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            raise DriverError(f"cannot connect the sandbox's network (pasta): {exc}") from exc
        finally:
            for fd in fds:
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
        request: ExecRequest,
        *,
        parent_joins_cgroup: bool,
        launch: _Launch,
        cap: int,
        cwd: Path,
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
                # With a launcher, it changes directory inside the new root.
                cwd=cwd if box.launcher is None else "/",
                env=dict(launch.env),
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(launch.child_fds),
            )
        except OSError as exc:
            raise DriverError(f"cannot start sandbox process: {exc}") from exc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with box.lock:
            box.procs[proc.pid] = proc
        child = _Child(proc, lambda: self._kill_exec(box, proc))
        try:
            try:
                for res, value in self._rlimits(box):
                    resource.prlimit(proc.pid, res, (value, value))
                if parent_joins_cgroup and box.cgroup is not None:
                    box.cgroup.add(proc.pid)  # v2: only the parent can move it
                os.write(proc.stdin.fileno(), b"go\n")
                self._after_go(box, proc, launch)
            except (OSError, DriverError) as exc:
                self._kill_exec(box, proc)
                proc.wait()
                if isinstance(exc, DriverError):
                    raise
                raise DriverError(f"cannot confine sandbox process: {exc}") from exc
            if request.on_start is not None:
                try:
                    request.on_start(proc.pid)
                except Exception:
                    logger.exception("on_start callback failed")
            io = exec_io.ExecIO(
                sources=[_Pipe(proc.stdout, exec_io.STDOUT), _Pipe(proc.stderr, exec_io.STDERR)],
                process=child,
                stdin=_Pipe(proc.stdin, 0) if request.stdin is not None else None,
                stdin_data=request.stdin,
                sample=lambda: self._sample_processes(box, proc),
            )
            if request.stdin is None:
                proc.stdin.close()
            outcome = exec_io.run(
                io,
                timeout_s=request.timeout_s,
                idle_timeout_s=request.idle_timeout_s,
                max_output_bytes=cap,
                redactor=box.redactor,
                on_stdout=request.on_stdout,
                on_stderr=request.on_stderr,
                start=start,
            )
            if not child.poll():
                self._kill_exec(box, proc)
                child.reap(block=True)
        finally:
            child.close()
            with box.lock:
                box.procs.pop(proc.pid, None)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
        assert child.status is not None
        code, signaled = _exit_code_from_status(child.status)
        sig = _signal_from_code(code, signaled, box.launcher is not None)
        self._sample_processes(box, proc)
        return ExecResult(
            exit_code=code,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            duration_s=outcome.duration_s,
            timed_out=outcome.timed_out,
            idle_timed_out=outcome.idle_timed_out,
            signal=sig,
            resources=self._usage(box, child.rusage, outcome.duration_s, cpu_before),
        )

    def _kill_exec(self, box: _Box, proc: subprocess.Popen[bytes]) -> None:
        # The leader's pid is the process group id (start_new_session); never getpgid()
        # after it may have been reaped.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if box.launcher is None and box.cgroup is not None:
            # Without a pid namespace, a setsid grandchild is only reachable by cgroup.
            box.cgroup.kill_all()

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
            # Without a cgroup: the leader's rusage, which holds every process that was
            # waited for up its tree (the namespace's init waits for the command, and the
            # launcher for the init): a lower bound when orphans were never reaped.
            if cpu is None:
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
            # One statvfs gives count, bytes and headroom of our own tmpfs: everything the
            # task wrote in its workspace, /tmp, /var/tmp and /dev/shm.
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
            running=self._running(box),
        )

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        """Nothing beyond destroy to release: the kernel already stopped the task."""
        del ctx, error

    def close(self) -> None:
        """Nothing process-wide to release (reaping happens per start and on cleanup)."""

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
        # Without our record of it, by id under our own root: never a path from the caller.
        root = (
            box.root
            if box is not None
            else self.workspace_root / f"{WORKSPACE_PREFIX}{validate_sandbox_id(ctx.id)}"
        )
        leftovers = self._destroy_resources(ctx.id, root, box.cgroup if box is not None else None)
        if leftovers:
            logger.warning("sandbox %s: could not remove %s", ctx.id, "; ".join(leftovers))
            # Keep the lease but hand it to nobody, so the next reaper retries.
            self.leases.write(Lease(ctx.id, self.name, Owner(0, None, ""), str(root)))
        else:
            self.leases.remove(ctx.id)

    def _destroy_resources(
        self, sandbox_id: str, root: Path, cgroup: SandboxCgroup | None = None
    ) -> list[str]:
        """Remove by id whatever exists under the sandbox's ``root`` (its tmpfs and every
        area in it); ``cgroup`` narrows the search when we know it."""
        left: list[str] = []
        support = self.host.cgroup
        if cgroup is not None:
            left += cgroup.remove()
        elif support.available:
            left += SandboxCgroup.from_paths(support, sandbox_id).remove()
        if root.exists() or root.is_symlink():
            # Only root can have mounted it; umount2 on a plain directory is a cheap EINVAL,
            # cheaper than scanning /proc/self/mountinfo.
            if self.host.tmpfs[0] and not root.is_symlink():
                try:
                    mounts.unmount(root)
                except OSError as exc:
                    left.append(str(exc))
            left += _remove_tree(root)
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


class _Pipe:
    """One of the exec's pipes as the shared loop sees it (an output source or stdin)."""

    def __init__(self, stream: IO[bytes], tag: int) -> None:
        self.fd = stream.fileno()
        self.stream = stream
        self.tag = tag
        os.set_blocking(self.fd, False)

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[tuple[int, bytes]] | None:
        data = os.read(self.fd, exec_io.READ_CHUNK)
        return None if not data else [(self.tag, data)]

    def finish(self) -> list[tuple[int, bytes]]:
        return []

    def write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def close(self) -> None:
        self.stream.close()


class _Child:
    """The exec's leader: a pidfd for its exit (Linux 5.3+; polled otherwise), wait4 for
    its status and rusage, and the kill that reaches its whole tree."""

    def __init__(self, proc: subprocess.Popen[bytes], kill: Callable[[], None]) -> None:
        self.proc = proc
        self._kill = kill
        self.status: int | None = None
        self.rusage: resource.struct_rusage | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def exit_fd(self) -> int | None:
        return self.pidfd

    def poll(self) -> bool:
        return self.reap(block=False)

    def reap(self, *, block: bool) -> bool:
        if self.status is not None:
            return True
        try:
            pid, status, rusage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            self.status = 0
            return True
        if pid == 0:
            return False
        self.status, self.rusage = status, rusage
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return True

    def kill(self) -> None:
        self._kill()

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class _Launch:
    """The fds of one exec's launch: those the child inherits (closed in the parent once
    it runs) and those the parent keeps (handshakes with bwrap/nsinit), all closed at the
    end, whatever happens."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    child_fds: list[int] = field(default_factory=list)
    parent_fds: list[int] = field(default_factory=list)
    info_r: int | None = None
    block_w: int | None = None
    status_r: int | None = None
    pasta_pidfds: list[int] = field(default_factory=list)

    def child(self, fd: int) -> int:
        self.child_fds.append(fd)
        return fd

    def parent(self, fd: int) -> int:
        self.parent_fds.append(fd)
        return fd

    def close_child_ends(self) -> None:
        """After the child started: our copies of its ends, so EOF on a handshake pipe
        means the other side is gone."""
        for fd in self.child_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.child_fds.clear()

    def close(self) -> None:
        self.close_child_ends()
        for fd in self.parent_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.parent_fds.clear()


def _read_child_pid(fd: int, deadline: float, proc: subprocess.Popen[bytes]) -> int:
    """The sandbox's pid from the launcher's info fd (bwrap's JSON, or nsinit's)."""
    data = b""
    while True:
        try:
            info = json.loads(data)
            return int(info["child-pid"])
        except (ValueError, KeyError, TypeError):
            pass
        chunk = _read_some(fd, deadline)
        if not chunk:
            raise DriverError(
                f"the sandbox launcher exited before its network was set up (exit {proc.poll()})"
            )
        data += chunk


def _read_some(fd: int, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DriverError("the sandbox launcher did not answer in time")
    ready, _, _ = select.select([fd], [], [], remaining)
    if not ready:
        raise DriverError("the sandbox launcher did not answer in time")
    return os.read(fd, 4096)


def _read_until_eof(fd: int, deadline: float) -> bytes:
    """nsinit's status fd: EOF alone (closed by the command's exec) means it started."""
    data = b""
    while chunk := _read_some(fd, deadline):
        data += chunk
    return data


def _stop_pasta(pidfd: int) -> None:
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        ready, _, _ = select.select([pidfd], [], [], PASTA_STOP_GRACE_S)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def _relative_to(path: Path, base: Path) -> Path | None:
    try:
        return path.relative_to(base)
    except ValueError:
        return None


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

"""``ProcessDriver``: provision, exec, observe and destroy sandboxes made of host
processes; the package docstring lists the layers, the sibling modules do the work."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.linux import (
    DEFAULT_PATH,
    SHIM,
    SHIM_NAME,
    bwrap_exec_failure,
    exit_code_from_status,
    remove_tree,
    signal_from_code,
)
from devs_sandbox.drivers.process import areas, network, plan, reaper, spawn, usage
from devs_sandbox.drivers.process.state import PROMISED, WORKSPACE_PREFIX, Box, Plan
from devs_sandbox.errors import (
    DriverError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    SandboxNotFoundError,
    WeakerIsolationError,
)
from devs_sandbox.isolation import HostSupport, layout, mounts, probe_host
from devs_sandbox.isolation.cgroups import CgroupLimits, SandboxCgroup
from devs_sandbox.leases import LEASE_GRACE_S, Lease, LeaseRegistry, Owner
from devs_sandbox.models import (
    ENV_NAME,
    ExecResult,
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

# A bwrap that dies in its mount setup (the command never ran) is started again, this
# many times in all, pausing twice as long each time (5, 10, 20, 40 ms). Measured: 1.6% of
# first tries fail with 8 callers at once; 25% under a mount churn no real host makes,
# where 3 tries still left 2% of runs failed and 5 leave about 0.1%.
LAUNCH_ATTEMPTS: Final = 5
LAUNCH_RETRY_PAUSE_S: Final = 0.005


class ProcessDriver:
    """Runs sandboxes as host processes; see the package docstring for the layers."""

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
        self._boxes: dict[str, Box] = {}
        self._lock = threading.Lock()

    # -- host support ---------------------------------------------------------------
    @property
    def host(self) -> HostSupport:
        if self._host is None:
            self._host = probe_host()
        return self._host

    def sandbox_user(
        self, config: SandboxLifecycleConfig, sandbox_id: str | None = None
    ) -> tuple[int, int]:
        """The (uid, gid) a sandbox of ``config`` runs as (any sandbox's when no id)."""
        return plan.run_as(config, self.leases, sandbox_id)

    def _plan(self, config: SandboxLifecycleConfig, uid: int) -> Plan:
        return plan.plan(self.host, config, uid)

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" if it will be in effect for ``config``, else the reason why not."""
        uid, _gid = self.sandbox_user(config)
        return self._plan(config, uid).report

    def namespace_launcher(self, config: SandboxLifecycleConfig) -> str | None:
        """ "bwrap" or "unshare": what gives ``config`` its namespaces here; None: nothing."""
        uid, _gid = self.sandbox_user(config)
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
        plan.check_required(report, required)

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
        uid, gid = self.sandbox_user(config, sandbox_id)
        p = self._plan(config, uid)
        report = p.report
        plan.check_required(report, config.isolation.required)
        missing = {m: report[m] for m in PROMISED if report[m]}
        if p.network == "host" and config.network:
            missing.setdefault("net-namespace", "network requested without a namespace")
        if missing and not config.isolation.allow_weaker_isolation:
            raise WeakerIsolationError(missing)
        active = tuple(m for m, why in report.items() if not why)
        if "cgroup" in active:
            active = tuple(
                f"cgroup-v{self.host.cgroup.version}" if m == "cgroup" else m for m in active
            )
        if p.network == "pasta":
            active += ("network-pasta",)
        root = self.workspace_root / f"{WORKSPACE_PREFIX}{sandbox_id}"
        workspace = root / layout.WORKSPACE_DIR
        box = Box(sandbox_id, config, workspace, uid, gid, active, root=root)
        box.launcher, box.bwrap_path, box.network = p.launcher, p.bwrap_path, p.network
        box.warnings = p.warnings()
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
        labels = {"uid": str(uid), "namespaces": p.launcher or "none"}
        if box.cgroup is not None:
            labels["cgroup"] = ",".join(str(path) for path in box.cgroup.paths)
        return SandboxContext(
            id=sandbox_id,
            driver=self.name,
            workspace=workspace,
            isolation=active,
            labels=labels,
            warnings=box.warnings,
        )

    def _undo(self, box: Box) -> None:
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
            left += remove_tree(box.root)
        wipe(box.secrets.values())
        if box.leased:
            if left:
                logger.warning("sandbox %s: could not undo %s", box.id, "; ".join(left))
                self.leases.write(Lease(box.id, self.name, Owner(0, None, ""), str(box.root)))
            else:
                self.leases.remove(box.id)

    def _provision(self, box: Box, report: Mapping[str, str]) -> None:
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
                    q.file_count_limit + 1 + len(areas.structure(box)) + len(box.secrets),
                    box.uid,
                    box.gid,
                ),
            )
            box.mounted = True
        elif box.uid != os.geteuid():
            os.chown(box.root, box.uid, box.gid)
        areas.make_areas(box)
        if box.secrets and box.launcher is not None:
            areas.place_secrets(box)  # in the sandbox's /tmp: counted as structure
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
            areas.copy_in(box, cfg.copy_in)
        sandbox_areas = layout.sandbox_areas(box.root)
        box.scanner = WorkspaceScanner(
            box.root,
            walk_roots=[
                sandbox_areas["workspace"],
                *(sandbox_areas[n] for n in layout.TMP_DIRS.values()),
            ],
            budget_s=q.depth_scan_budget_ms / 1000,
        )
        if box.secrets and box.launcher is None:
            areas.place_secrets(box)  # after copy-in: a repository cannot plant over them

    # -- exec ---------------------------------------------------------------------------
    def _box(self, ctx: SandboxContext) -> Box:
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            raise SandboxNotFoundError(ctx.id)
        return box

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
        host_env = self._host_env if self._host_env is not None else os.environ
        env = spawn.sandbox_env(box, self.sanitizer, host_env, request.env)
        first, total_s = time.monotonic(), request.timeout_s
        for attempt in range(1, LAUNCH_ATTEMPTS + 1):
            launch = spawn.Launch()
            held = spawn.HeldOutput(launch, request.on_stdout, request.on_stderr)
            stops = box.stops
            try:
                result = self._launch(box, held.request(request), env, launch, cap=cap, cwd=cwd)
                retry = self._died_in_setup(box, launch, result, stops)
                if attempt == LAUNCH_ATTEMPTS or not retry:
                    held.flush()
                    return result
            finally:
                launch.close()
                for pidfd in launch.pasta_pidfds:
                    network.stop_pasta(pidfd)
            # bwrap died in its mount setup (containers/bubblewrap#650: another sandbox's
            # root went away while bwrap copied the mount table); the command never ran.
            left = None if total_s is None else total_s - (time.monotonic() - first)
            if left is not None and left <= LAUNCH_RETRY_PAUSE_S:
                held.flush()
                return result
            logger.info(
                "sandbox %s: bwrap failed before the command (%s); trying again",
                box.id,
                result.stderr.text.strip()[:200],
            )
            time.sleep(LAUNCH_RETRY_PAUSE_S * 2 ** (attempt - 1))
            request = dataclasses.replace(request, timeout_s=left)
        raise AssertionError("unreachable")

    def _died_in_setup(
        self, box: Box, launch: spawn.Launch, result: ExecResult, stops: int
    ) -> bool:
        """bwrap exited on its own in its setup (its die(): status 1), the command never
        ran (``Launch.never_started``), and nobody stopped the sandbox meanwhile: a
        force_stop or the timeout's kill during setup must never be answered by a restart."""
        if result.exit_code != 1 or result.signal is not None or result.timed_out:
            return False
        if result.idle_timed_out or not launch.never_started():
            return False
        with self._lock:
            return self._boxes.get(box.id) is box and box.stops == stops

    def _launch(
        self,
        box: Box,
        request: ExecRequest,
        env: dict[str, str],
        launch: spawn.Launch,
        *,
        cap: int,
        cwd: Path,
    ) -> ExecResult:
        """One try at starting the command and running it to its end."""
        spawn.prepare_launch(box, request.argv, env, launch, cwd)
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

    def _after_go(self, box: Box, proc: subprocess.Popen[bytes], launch: spawn.Launch) -> None:
        """Between the shim's "go" and the command: connect pasta to the sandbox's network
        namespace, then wait for the launcher to report that the command was exec'd."""
        launch.close_child_ends()
        deadline = time.monotonic() + network.NETWORK_SETUP_TIMEOUT_S
        if launch.info_r is not None and launch.block_w is not None:
            child_pid = spawn.read_child_pid(launch.info_r, deadline, proc)
            pasta = self.host.pasta
            assert pasta is not None
            launch.pasta_pidfds.append(network.start_pasta(box, pasta, child_pid, deadline))
            os.write(launch.block_w, b"1")
        if launch.status_r is not None:
            why = spawn.read_until_eof(launch.status_r, deadline)
            if why:
                raise DriverError(f"cannot start sandbox: {why.decode(errors='replace').strip()}")

    def _exec(
        self,
        box: Box,
        argv: list[str],
        request: ExecRequest,
        *,
        parent_joins_cgroup: bool,
        launch: spawn.Launch,
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
        child = spawn.Child(proc, lambda: self._kill_exec(box, proc))
        try:
            try:
                for res, value in spawn.rlimits(box):
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
                sources=[
                    spawn.Pipe(proc.stdout, exec_io.STDOUT),
                    spawn.Pipe(proc.stderr, exec_io.STDERR),
                ],
                process=child,
                stdin=spawn.Pipe(proc.stdin, 0) if request.stdin is not None else None,
                stdin_data=request.stdin,
                sample=lambda: usage.sample_processes(box, proc.pid),
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
        code, signaled = exit_code_from_status(child.status)
        if box.launcher == "bwrap":
            code = bwrap_exec_failure(request.argv[0], code, outcome.stderr.text) or code
        # bwrap and nsinit report a signalled command as 128 + N, as shells do.
        sig = signaled if signaled is not None or box.launcher is None else signal_from_code(code)
        usage.sample_processes(box, proc.pid)
        return ExecResult(
            exit_code=code,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            duration_s=outcome.duration_s,
            timed_out=outcome.timed_out,
            idle_timed_out=outcome.idle_timed_out,
            signal=sig,
            resources=usage.usage(box, child.rusage, outcome.duration_s, cpu_before),
        )

    def _kill_exec(self, box: Box, proc: subprocess.Popen[bytes]) -> None:
        # The leader's pid is the process group id (start_new_session); never getpgid()
        # after it may have been reaped.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if box.launcher is None and box.cgroup is not None:
            # Without a pid namespace, a setsid grandchild is only reachable by cgroup.
            box.cgroup.kill_all()

    # -- observe / stop ---------------------------------------------------------------
    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        return usage.metrics(self._box(ctx))

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

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            box = self._boxes.get(ctx.id)
        return box is not None and usage.running(box)

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every process of the sandbox; the workspace stays until ``destroy``."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            return
        with box.lock:
            box.stops += 1
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
        return reaper.destroy_resources(self.host, sandbox_id, root, cgroup)

    def reap_orphans(self) -> list[str]:
        """Destroy sandboxes whose owner died; also lease-less leftovers past the grace."""
        with self._lock:
            live = set(self._boxes)
        return reaper.reap_orphans(
            driver_name=self.name,
            leases=self.leases,
            host=self.host,
            workspace_root=self.workspace_root,
            live=live,
            lease_grace_s=self.lease_grace_s,
            destroy=self._destroy_resources,
        )

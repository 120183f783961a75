"""``DockerDriver``: the driver protocol over one engine, its collaborators doing the work
(``provision``, ``execs``, ``removal``, ``pool``) and the exhaustion handler's view of
the engine (``exhaustion.ContainerOps``)."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.docker.execs import SECRETS_DIR, Execs
from devs_sandbox.drivers.docker.hardening import INFRA_PROCESSES, MECHANISMS
from devs_sandbox.drivers.docker.pool import WarmPool
from devs_sandbox.drivers.docker.provision import Provisioner
from devs_sandbox.drivers.docker.removal import Removal, Remover
from devs_sandbox.drivers.docker.state import (
    HOST_DIR_PREFIX,
    LABEL_MANAGED,
    LABEL_OWNER_PID,
    LABEL_OWNER_START,
    LABEL_SANDBOX,
    STOP_WAIT_S,
    TMP,
    WORKSPACE,
    Box,
    exited,
)
from devs_sandbox.engine import ENGINE_TIMEOUT_S, connect, docker_sdk, engine_errors
from devs_sandbox.errors import (
    DevsSandboxError,
    DiskQuotaExceededError,
    DriverError,
    DriverUnavailableError,
    ImageUnavailableError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    SandboxNotFoundError,
    SecurityConfigError,
)
from devs_sandbox.exhaustion import DockerOomEvents, ResourceExhaustionHandler, SandboxManager
from devs_sandbox.images import ImageResolver, ResolvedImage
from devs_sandbox.isolation.cgroups import CgroupCounters, CgroupSupport, detect
from devs_sandbox.leases import LeaseRegistry, Owner
from devs_sandbox.models import (
    ExecResult,
    SandboxContext,
    SandboxMetrics,
    new_sandbox_id,
    validate_sandbox_id,
)
from devs_sandbox.security.session_keys import Redactor, validate_secrets, wipe

if TYPE_CHECKING:
    from docker import DockerClient


class DockerDriver:
    """Runs each sandbox in a hardened container; see the package docstring."""

    name = "docker"

    def __init__(
        self,
        *,
        emit: Emit | None = None,
        client: DockerClient | None = None,
        base_url: str | None = None,
        leases: LeaseRegistry | None = None,
        workspace_root: Path | None = None,
        engine_timeout_s: float = ENGINE_TIMEOUT_S,
        host_config_overrides: Mapping[str, Any] | None = None,
        watch_oom: bool = True,
        extra_labels: Mapping[str, str] | None = None,
    ) -> None:
        """``host_config_overrides`` are merged into every HostConfig (and validated like
        the rest); ``extra_labels`` mark containers (tests use them to find their own)."""
        docker_sdk()  # fail here, with the install hint, when the SDK is missing
        self._emit = emit
        self._client = client
        self._owns_client = client is None  # close() closes only a client we made
        self._base_url = base_url
        self.leases = leases or LeaseRegistry()
        self.workspace_root = workspace_root or Path(tempfile.gettempdir())
        self.engine_timeout_s = engine_timeout_s
        self.host_config_overrides = dict(host_config_overrides or {})
        self.watch_oom = watch_oom
        self.extra_labels = dict(extra_labels or {})
        self.boxes: dict[str, Box] = {}
        self.by_container: dict[str, str] = {}  # container id -> sandbox id, kept after destroy
        self.lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._cg: CgroupSupport | None = None
        self._resolved: dict[tuple[str | None, tuple[str, ...], bool, bool], ResolvedImage] = {}
        self.owner = Owner.current()
        self.exhaustion = ResourceExhaustionHandler(
            self, emit=self._emit_event, temp_root=self.workspace_root
        )
        self.oom_watcher: SandboxManager | None = None
        # One collaborator per concern, each holding this driver (package-internal): the
        # names above without an underscore are what they use of it.
        self.provisioner = Provisioner(self)
        self.execs = Execs(self)
        self.removal = Removal(self)
        self.pool = WarmPool(self)
        self.remover = Remover(self)
        self._closed = False

    # -- engine --------------------------------------------------------------------------
    @property
    def client(self) -> DockerClient:
        if self._client is None:
            with self.lock:
                if self._client is None:
                    self._client = connect(self.engine_timeout_s, self._base_url)
        return self._client

    def _emit_event(self, event: str, payload: dict[str, Any]) -> None:
        if self._emit is not None:
            self._emit(event, payload)

    def engine_info(self) -> dict[str, Any]:
        if self._info is None:
            with engine_errors("docker info"):
                self._info = dict(self.client.info())
        return self._info

    @property
    def cgroups(self) -> CgroupSupport:
        if self._cg is None:
            self._cg = detect(require_writable=False)
        return self._cg

    def resolver(self, config: SandboxLifecycleConfig) -> ImageResolver:
        d = config.docker
        return ImageResolver(
            self.client,
            fallback_images=d.fallback_images,
            pull=d.pull,
            pull_timeout_s=d.pull_timeout_s,
            rebuild=d.rebuild_default_image,
            base_url=self._base_url,
        )

    def resolve_image(self, config: SandboxLifecycleConfig) -> ResolvedImage:
        """The image ``config`` runs, resolved once per process (re-resolved if it vanishes)."""
        name = config.image or config.docker.default_image
        d = config.docker
        key = (name, d.fallback_images, d.pull, d.rebuild_default_image)
        with self.lock:
            hit = self._resolved.get(key)
        if hit is not None:
            return hit
        resolved = self.resolver(config).resolve(name)
        with self.lock:
            self._resolved[key] = resolved
        return resolved

    def forget_image(self) -> None:
        with self.lock:
            self._resolved.clear()

    def _ensure_watcher(self) -> None:
        if not self.watch_oom or self._closed:
            return
        with self.lock:
            if self.oom_watcher is not None:
                return
            owner = self.owner
            labels = (
                f"{LABEL_MANAGED}=true",
                f"{LABEL_OWNER_PID}={owner.pid}",
                f"{LABEL_OWNER_START}={owner.start_ticks or ''}",
            )
            self.oom_watcher = SandboxManager(
                self.exhaustion,
                source=DockerOomEvents(labels=labels, base_url=self._base_url),
            )
        self.oom_watcher.start()

    # -- isolation ---------------------------------------------------------------------------
    def exec_cgroup_reason(self) -> str:
        if os.geteuid() != 0:
            return "needs root to make a cgroup per exec; an exec timeout kills the container"
        cg = self.cgroups
        if not cg.available:
            return f"no cgroup hierarchy here ({cg.reason}); an exec timeout kills the container"
        return ""

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" when a container for ``config`` will have it, else why not."""
        try:
            info = self.engine_info()
        except DevsSandboxError as exc:
            return dict.fromkeys(MECHANISMS, f"Docker engine not available: {exc}")
        report: dict[str, str] = dict.fromkeys(MECHANISMS, "")
        if not (info.get("MemoryLimit", True) and info.get("PidsLimit", True)):
            report["cgroup"] = "the engine cannot enforce memory and pids limits on this host"
        if config.network:
            report["net-namespace"] = "network requested (--network)"
        uid = self.provisioner.user(config, None)[1]
        if uid == 0:
            report["unprivileged-user"] = "sandbox runs as root (isolation.runAsUser)"
        security = " ".join(str(o) for o in info.get("SecurityOptions") or ())
        if "seccomp" not in security:
            report["seccomp"] = "the engine has no seccomp support"
        report["exec-cgroup"] = self.exec_cgroup_reason()
        return report

    def active(self, report: Mapping[str, str]) -> tuple[str, ...]:
        version = str(self.engine_info().get("CgroupVersion") or self.cgroups.version or "1")
        return tuple(
            f"cgroup-v{version}" if m == "cgroup" else m for m, why in report.items() if not why
        )

    # -- provision ---------------------------------------------------------------------------
    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """Create (or take from the warm pool) a hardened container. ``secrets`` are written
        through an exec's stdin into the container's private /tmp tmpfs, 0400, and named to
        each exec by ``NAME_FILE``: never in the container's environment or any argv, so
        ``docker inspect`` cannot show them."""
        if self._closed:
            raise DriverError("the docker driver was closed")
        validate_secrets(secrets)
        requested = validate_sandbox_id(config.sandbox_id) if config.sandbox_id else None
        report = self.isolation_report(config)
        missing: dict[str, str] = {}
        for m in config.isolation.required:
            why = report.get(m, "unknown mechanism")
            if why:
                missing[m] = why
        if missing:
            raise IsolationUnavailableError(missing)
        try:
            plan = self.provisioner.plan(config)
        except DriverError as exc:
            if isinstance(exc, ProvisionError | DriverUnavailableError | ImageUnavailableError):
                raise
            raise ProvisionError(f"cannot provision a docker sandbox: {exc}") from exc
        self._ensure_watcher()
        active = self.active(report)
        pool_size = config.docker.warm_pool_size
        if pool_size and requested is None and config.copy_in is None:
            box = self.pool.take(plan, pool_size)
            if box is not None:
                box.plan = plan  # same container shape; this run's output cap and budgets
                with self.lock:
                    self.boxes[box.id] = box
                try:
                    self._place_secrets(box, secrets)
                except BaseException:
                    self.destroy(self._context(box))
                    raise
                return self._context(box)
        sandbox_id = requested or new_sandbox_id()
        box = Box(sandbox_id, plan, self.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}", active)
        with self.lock:
            if sandbox_id in self.boxes:
                raise ProvisionError(f"sandbox {sandbox_id} already exists")
            self.boxes[sandbox_id] = box
        try:
            self.provisioner.create(box)
            if config.copy_in is not None:
                self.provisioner.copy_in(box, config.copy_in)
            self._place_secrets(box, secrets)
        except BaseException as exc:
            self.removal.undo(box)
            if isinstance(exc, ProvisionError | SecurityConfigError | DriverUnavailableError):
                raise
            if isinstance(exc, ImageUnavailableError):
                raise
            if isinstance(exc, DevsSandboxError | OSError):
                raise ProvisionError(f"cannot provision sandbox {sandbox_id}: {exc}") from exc
            raise
        return self._context(box)

    def _place_secrets(self, box: Box, secrets: Mapping[str, bytes | bytearray] | None) -> None:
        """Remember the secrets; they are written by the first exec (``_write_secrets``),
        so a warm container costs no extra exec to receive them."""
        if not secrets:
            return
        box.secrets = {name: bytearray(value) for name, value in secrets.items()}
        box.redactor = Redactor(box.secrets)
        box.secret_env = {f"{name}_FILE": f"{SECRETS_DIR}/{name}" for name in box.secrets}
        box.secrets_pending = True

    def _context(self, box: Box) -> SandboxContext:
        labels = {
            "container_id": box.container_id,
            "container_name": box.name,
            "image": box.plan.image.reference,
            "image_source": box.plan.image.source,
            "user": box.plan.user,
            "workspace_in_container": WORKSPACE,
        }
        return SandboxContext(
            id=box.id,
            driver=self.name,
            workspace=box.host_dir,
            isolation=box.isolation,
            labels=labels,
        )

    # -- exec ---------------------------------------------------------------------------------
    def _box(self, ctx: SandboxContext) -> Box:
        with self.lock:
            box = self.boxes.get(ctx.id)
        if box is None:
            raise SandboxNotFoundError(ctx.id)
        return box

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        box = self._box(ctx)
        return self.execs.run(box, request.replace(env={**box.secret_env, **request.env}))

    # -- observe / stop --------------------------------------------------------------------------
    def counters(self, box: Box) -> CgroupCounters:
        """The container's cgroup counters; the last ones read once it is gone (cumulative
        counters stay true after the container stops)."""
        if box.cgroup is not None and self.alive(box):
            c = box.cgroup.counters()
            if c.memory_bytes is not None or c.pids_current is not None:
                box.last = c
                return c
        return box.last

    def alive(self, box: Box) -> bool:
        if box.init_pidfd is not None:
            return not exited(box.init_pidfd)
        if not box.container_id:
            return False
        try:
            with engine_errors("inspect container"):
                state = self.client.api.inspect_container(box.container_id)["State"]
        except DevsSandboxError:
            return False
        return bool(state.get("Running"))

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        box = self._box(ctx)
        alive = self.alive(box)
        c = self.counters(box)
        procs = None if c.pids_current is None else max(0, c.pids_current - INFRA_PROCESSES)
        if procs is not None and alive:
            box.peak_processes = max(box.peak_processes, procs)
        # The engine's event may beat the cgroup read, or arrive after the container is gone.
        oom = (
            None
            if c.oom_kills is None and not box.oom_events
            else max(c.oom_kills or 0, box.oom_events)
        )
        file_count = depth = largest = disk = inodes_free = disk_free = None
        if alive and box.init_pid is not None:
            root = Path(f"/proc/{box.init_pid}/root")
            frees: list[tuple[int, int]] = []
            for mount in (WORKSPACE, TMP):
                with contextlib.suppress(OSError):
                    st = os.statvfs(f"{root}{mount}")
                    frees.append((st.f_ffree, st.f_bavail * st.f_frsize))
                    if mount == WORKSPACE:
                        file_count = max(0, st.f_files - st.f_ffree - 1)  # minus the root inode
                        disk = (st.f_blocks - st.f_bfree) * st.f_frsize
            if frees:
                inodes_free = min(f[0] for f in frees)
                disk_free = min(f[1] for f in frees)
            scan = box.scanner.scan() if box.scanner is not None else None
            # The pidfd proves init was ours before and after the walk: a recycled pid's
            # /proc/<pid>/root would have been someone else's tree.
            if scan is not None and self.alive(box):
                depth, largest = scan.max_depth, scan.largest_file_bytes
        return SandboxMetrics(
            sandbox_id=box.id,
            timestamp=time.monotonic(),
            process_count=procs if alive else 0,
            memory_bytes=c.memory_bytes if alive else None,
            peak_memory_bytes=c.peak_memory_bytes,
            cpu_time_s=c.cpu_time_s,
            file_count=file_count,
            directory_depth=depth,
            largest_file_bytes=largest,
            disk_bytes=disk,
            inodes_free=inodes_free,
            disk_free_bytes=disk_free,
            pids_limit_hits=c.pids_limit_hits,
            oom_kills=oom,
            running=alive,
        )

    def live_sandboxes(self) -> list[SandboxContext]:
        """The sandboxes this driver holds (provisioned, not yet destroyed)."""
        with self.lock:
            boxes = list(self.boxes.values())
        return [self._context(box) for box in boxes]

    def is_running(self, ctx: SandboxContext) -> bool:
        with self.lock:
            box = self.boxes.get(ctx.id)
        return box is not None and self.alive(box)

    def stop_box(self, box: Box) -> None:
        """SIGKILL init: the kernel kills everything else in its pid namespace with it."""
        if box.init_pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(box.init_pidfd, signal.SIGKILL)
            if exited(box.init_pidfd, STOP_WAIT_S):
                return
        if box.container_id:
            with contextlib.suppress(DevsSandboxError), engine_errors("kill container"):
                self.client.api.kill(box.container_id, signal="SIGKILL")

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every process; the stopped container stays (inspectable) until destroy."""
        with self.lock:
            box = self.boxes.get(ctx.id)
        if box is not None:
            self.stop_box(box)

    # -- destroy --------------------------------------------------------------------------------
    # REQ: 8_RISKS-REQ-123
    def member_pids(self, ctx: SandboxContext) -> list[int]:
        """Host pids of every process in the container (its cgroup): what a double fork
        re-parented to the container's init still belongs to."""
        with self.lock:
            box = self.boxes.get(ctx.id)
        if box is None or box.cgroup is None:
            return []
        return box.cgroup.all_pids()

    def destroy(self, ctx: SandboxContext) -> None:
        with self.lock:
            box = self.boxes.pop(ctx.id, None)
        if box is None:
            self.removal.remove_by_id(ctx.id, ctx.workspace, ctx.labels.get("container_id") or None)
            return
        wipe(box.secrets.values())
        box.secrets.clear()
        with box.lock:
            sock, box.launcher_sock, box.launcher_keep = box.launcher_sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        if box.config.docker.warm_pool_size and box.init_pidfd is not None:
            # Warm-pool mode trades a synchronous remove (~50 ms) for a kill that is total at
            # once (pid namespace) and a removal in the background; the lease stays until the
            # container is gone, and close() waits for it.
            self.stop_box(box)
            self.remover.submit(box)
            return
        self.removal.finish(box)

    def reap_orphans(self) -> list[str]:
        """Remove containers labelled ``devs.managed=true`` whose owner process is gone, and
        docker leases whose owner is gone; never another driver's, never a live owner's."""
        return self.removal.reap_orphans()

    # -- the exhaustion handler's view of the engine (exhaustion.ContainerOps) ---------------
    def _box_for_container(self, container_id: str) -> Box | None:
        with self.lock:
            sandbox_id = self.by_container.get(container_id)
            if sandbox_id is None:
                for cid, sid in self.by_container.items():
                    if cid.startswith(container_id) or container_id.startswith(cid):
                        sandbox_id = sid
                        break
            return self.boxes.get(sandbox_id) if sandbox_id else None

    def note_oom(self, container_id: str) -> None:
        box = self._box_for_container(container_id)
        if box is not None:
            with box.lock:
                box.oom_events += 1
            self.counters(box)  # keep the peak and the counters from before the teardown

    def sandbox_id_of(self, container_id: str) -> str | None:
        with self.lock:
            known = self.by_container.get(container_id)
        if known is not None:
            return known
        try:
            with engine_errors("inspect container"):
                labels = self.client.api.inspect_container(container_id)["Config"]["Labels"] or {}
        except DevsSandboxError:
            return None
        value = labels.get(LABEL_SANDBOX)
        return str(value) if value else None

    def is_container_running(self, container_id: str) -> bool:
        box = self._box_for_container(container_id)
        if box is not None:
            return self.alive(box)
        try:
            with engine_errors("inspect container"):
                return bool(self.client.api.inspect_container(container_id)["State"]["Running"])
        except DevsSandboxError:
            return False

    def stop_container(self, container_id: str) -> None:
        box = self._box_for_container(container_id)
        if box is not None:
            self.stop_box(box)
            return
        docker = docker_sdk()
        with engine_errors(f"kill container {container_id[:24]}"):
            try:
                self.client.api.kill(container_id, signal="SIGKILL")
            except docker.errors.APIError as exc:
                if exc.status_code not in (404, 409):  # gone, or not running: stopped either way
                    raise

    def remove_container(self, container_id: str) -> None:
        """``docker rm -f``: a container that is already gone (or going) is fine. The box
        remembers it, so the lifecycle's destroy after a full workspace or an OOM kill does
        not remove the container a second time."""
        box = self._box_for_container(container_id)
        self.removal.remove_container(container_id)
        if box is not None:
            with box.lock:
                box.container_removed = True

    # -- optional capabilities ------------------------------------------------------------------
    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        """The lifecycle routes a full workspace here: the handler reports and cleans up."""
        if not isinstance(error, DiskQuotaExceededError):
            return
        with self.lock:
            box = self.boxes.get(ctx.id)
        container = box.container_id if box is not None else ctx.labels.get("container_id")
        if container:
            self.exhaustion.on_disk_quota_exceeded(container)

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        """Runtimes the image declares (``devs.runtimes``); None when it declares nothing."""
        try:
            image = self.resolve_image(config)
        except DevsSandboxError:
            return None
        return None if image.runtimes is None else frozenset(image.runtimes)

    def close(self) -> None:
        """Stop the OOM watcher, drop the warm pool, finish background removals."""
        self._closed = True
        watcher = self.oom_watcher
        if watcher is not None:
            watcher.shutdown()
        self.pool.close()
        self.remover.close()
        if self._owns_client:
            with self.lock:
                client, self._client = self._client, None  # a later destroy reconnects
            if client is not None:
                client.close()

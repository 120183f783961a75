"""The Kubernetes driver: one hardened pod per sandbox, plain Pods, no CRD.

Provision: the owner Lease (once per process), the sandbox's deny-all NetworkPolicy, then
its Pod (both validated before the create and again as the server stored them; the policy
is then owned by the pod too), a wait for Running (pushed by the pod watch, polled as a
fallback; an image that cannot be pulled or a pod no node can take fails with the
cluster's reason), and one probe exec that learns what the image offers and checks from
inside that the network is really closed. A 403 "exceeded quota" is a ``CapacityError``
at once. With ``warmPoolSize`` the pod comes from the warm pool instead (``pool.py``).

Exec: ``runner.py`` (the shim, the supervisor, the WebSocket, the shared exec loop). The
exit status is channel 3's; a missing one is a lost exec (``ExecLostError``, its processes
killed first) unless the pod itself died under the command (then 137, and the watch says
why). Metrics are one exec of ``shim.SAMPLE`` per call; OOM kills are counted from the pod
watch (OOMKilled, memory eviction) and the pod's cgroup ``oom_kill`` counter, so a kill
that left no trace in the pod status (an exec'd process on a cgroup v1 node) is still
recorded, before anything deletes the pod.

Invariant: ``destroy`` is idempotent and deletes the pod and its policy; whatever a crash
leaves is owned by a Lease that stops being renewed, so the reaper and the garbage
collector remove it (``leases.py``).

Size (~800 lines, over the house's ~600): the class is the protocol's surface plus a pod's
whole life (create, wait, probe, undo, exec, observe, stop), which all read and write the
same ``Box`` under one lock; every part with a concern of its own already lives apart
(manifest, client, transport, runner, shim, watcher, leases, pool). Splitting the life of
a pod across files would scatter that one lock's invariants.
"""

from __future__ import annotations

import contextlib
import logging
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

from devs_sandbox.base import Emit, ExecRequest
from devs_sandbox.config import KubernetesConfig, SandboxLifecycleConfig
from devs_sandbox.drivers.kubernetes import shim
from devs_sandbox.drivers.kubernetes.box import Box, Plan
from devs_sandbox.drivers.kubernetes.client import (
    JSON_PATCH,
    PODS,
    POLICIES,
    ApiError,
    Cluster,
    connect,
    kubernetes_sdk,
)
from devs_sandbox.drivers.kubernetes.leases import OwnerLease, reap
from devs_sandbox.drivers.kubernetes.manifest import (
    LABEL_MANAGED,
    LABEL_OWNER,
    MANAGED_BY,
    WORKSPACE,
    Manifest,
    build_manifest,
    image_of,
    pick_uid,
    pod_name,
    validate_network_policy,
    validate_pod_spec,
)
from devs_sandbox.drivers.kubernetes.pool import WarmPool, warm_manifest
from devs_sandbox.drivers.kubernetes.runner import ExecRunner
from devs_sandbox.drivers.kubernetes.shim import ProbeInfo, Sample, parse_sample
from devs_sandbox.drivers.kubernetes.transport import HandshakeError
from devs_sandbox.drivers.kubernetes.watcher import PodWatcher
from devs_sandbox.errors import (
    CapacityError,
    ConfigError,
    DevsSandboxError,
    DriverError,
    DriverUnavailableError,
    ExecLostError,
    ImageUnavailableError,
    IsolationUnavailableError,
    ProvisionError,
    QuotaExceededError,
    SandboxNotFoundError,
    SecretError,
    WeakerIsolationError,
)
from devs_sandbox.events import SandboxEvents
from devs_sandbox.models import (
    ExecResult,
    ResourceUsage,
    SandboxContext,
    SandboxMetrics,
    new_sandbox_id,
    utc_now_iso,
    validate_sandbox_id,
)
from devs_sandbox.security.session_keys import Redactor, validate_secrets, wipe

logger = logging.getLogger(__name__)

MECHANISMS: Final = (
    "rlimits",
    "cgroup",
    "pid-namespace",
    "mount-namespace",
    "net-namespace",
    "seccomp",
    "tmpfs-workspace",
    "unprivileged-user",
    "cap-drop-all",
    "no-new-privileges",
    "read-only-rootfs",
    "network-policy",
    "exec-subreaper",
    "user-namespace",
    "runtime-class",
)
STRICT: Final = {"fieldValidation": "Strict"}
PROBE_TIMEOUT_S: Final = 30.0  # one exec; it waits up to 3 s for a policy to take effect
SAMPLE_TIMEOUT_S: Final = 10.0  # cgroup files, a task count, statvfs and a bounded find
FORCE_STOP_TIMEOUT_S: Final = 10.0  # one exec of kill -KILL -1
POLL_FALLBACK_S: Final = 1.0  # without a watch event, read the pod this often while waiting
MAX_SIGNAL: Final = 64
SECRET_FAILURE: Final = "devs-sandbox: cannot write the secrets"  # noqa: S105 - a message


def _pending(box: Box) -> bool:
    return box.secrets_pending


def _signal_of(code: int) -> int | None:
    return code - 128 if 128 < code <= 128 + MAX_SIGNAL else None


class KubernetesDriver:
    """Runs each sandbox in a hardened pod; see the module docstring."""

    name = "kubernetes"

    def __init__(
        self,
        *,
        emit: Emit | None = None,
        kubernetes: KubernetesConfig | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        """``kubernetes`` names the cluster (kubeconfig, context, namespace) this driver
        binds to on first use; ``cluster`` hands it a client ready-made (tests)."""
        kubernetes_sdk()  # fail here, with the install hint, when the client is missing
        self._emit = emit
        self.settings = kubernetes or KubernetesConfig()
        self._cluster = cluster
        self._coords = None if cluster is not None else self._coords_of(self.settings)
        self._boxes: dict[str, Box] = {}  # by sandbox id
        self._by_pod: dict[str, Box] = {}  # by pod name (also pods being filled for the pool)
        self._lock = threading.RLock()
        self._lease: OwnerLease | None = None
        self._watcher: PodWatcher | None = None
        self._runner: ExecRunner | None = None
        self.pool = WarmPool(self)
        self._closed = False

    # -- the cluster -------------------------------------------------------------------------
    @staticmethod
    def _coords_of(k: KubernetesConfig) -> tuple[str | None, str | None, str | None]:
        return (str(k.kubeconfig) if k.kubeconfig else None, k.context, k.namespace)

    @property
    def cluster(self) -> Cluster:
        return self._bind(self.settings)

    @property
    def runner(self) -> ExecRunner:
        self._bind(self.settings)
        assert self._runner is not None
        return self._runner

    @property
    def lease(self) -> OwnerLease:
        self._bind(self.settings)
        assert self._lease is not None
        return self._lease

    def _bind(self, k: KubernetesConfig) -> Cluster:
        """Connect on first use; a later config naming another cluster is refused."""
        with self._lock:
            if self._coords is not None and self._coords_of(k) != self._coords:
                raise ConfigError(
                    "this kubernetes driver is bound to one cluster and namespace "
                    f"{self._coords}; a run asked for {self._coords_of(k)}",
                    key="sandbox.kubernetes",
                )
            if self._cluster is None:
                self._cluster = connect(k)
            if self._lease is None:
                cluster = self._cluster
                self._lease = OwnerLease(cluster, self.settings.lease_duration_s)
                self._runner = ExecRunner(cluster)
                selector = f"{LABEL_MANAGED}={MANAGED_BY},{LABEL_OWNER}={self._lease.name}"
                self._watcher = PodWatcher(cluster, selector, self._on_pod, self._on_list)
            return self._cluster

    def ensure_watch(self) -> None:
        """Start the pod watch (once): before the first pod of ours exists."""
        self._bind(self.settings)
        with self._lock:
            if self._watcher is not None and not self._watcher.started:
                self._watcher.start()

    @property
    def watcher(self) -> PodWatcher | None:
        return self._watcher

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        name = str((pod.get("metadata") or {}).get("name"))
        with self._lock:
            box = self._by_pod.get(name)
        self.pool.on_pod(kind, pod)
        if box is None:
            return
        if kind == "DELETED":
            box.gone = True
            box.changed.set()
            return
        old, new = box.observe(pod)
        if new.oom and not old.oom:
            logger.warning("sandbox %s: pod %s ended by %s", box.id, name, new.reason)
            self._emit_event(
                SandboxEvents.OOM,
                {
                    "sandbox_id": box.id,
                    "pod": name,
                    "reason": new.reason,
                    "timestamp": utc_now_iso(),
                },
            )
        elif new.finished and not old.finished:
            logger.warning("sandbox %s: pod %s ended: %s %s", box.id, name, new.reason, new.message)

    def _on_list(self, names: set[str]) -> None:
        with self._lock:
            boxes = [b for n, b in self._by_pod.items() if n not in names and b.pod_uid]
        for box in boxes:
            box.gone = True
            box.changed.set()

    def _emit_event(self, event: str, payload: dict[str, Any]) -> None:
        if self._emit is not None:
            self._emit(event, payload)

    # -- isolation ---------------------------------------------------------------------------
    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" when a pod for ``config`` will have it, else why not."""
        k = config.kubernetes
        report = dict.fromkeys(MECHANISMS, "")
        if config.network:
            report["net-namespace"] = report["network-policy"] = "network requested (--network)"
        if k.host_users:
            report["user-namespace"] = "kubernetes.hostUsers is true: the pod's uids are the node's"
        if not k.runtime_class_name:
            report["runtime-class"] = "no kubernetes.runtimeClassName: the node's kernel is shared"
        return report

    def _settle(
        self, config: SandboxLifecycleConfig, probe: ProbeInfo
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(isolation in effect, warnings) for a pod whose probe said ``probe``; refuses
        the pod when a promised layer is missing and weaker isolation was not allowed."""
        report = self.isolation_report(config)
        problems: dict[str, str] = {}
        if not probe.nproc_flag:
            problems["rlimits"] = "the image's /bin/sh cannot set a process limit (ulimit -u)"
        if not config.network and config.kubernetes.verify_network_isolation:
            if probe.network == "open":
                problems["net-namespace"] = (
                    "the pod reached the API server: the cluster's CNI does not enforce the "
                    "deny-all NetworkPolicy"
                )
            elif probe.network not in ("none", "blocked"):
                problems["net-namespace"] = (
                    "the deny-all NetworkPolicy could not be verified from inside the pod (an "
                    "image without python3?); kubernetes.verifyNetworkIsolation false trusts it"
                )
        if problems and not config.isolation.allow_weaker_isolation:
            raise WeakerIsolationError(problems)
        report.update(problems)
        if "net-namespace" in problems:
            report["network-policy"] = problems["net-namespace"]
        if not probe.supervisor:
            report["exec-subreaper"] = "no python3 in the image: an exec timeout kills every task"
        wanted = {str(m): report.get(m) or "" for m in config.isolation.required}
        missing = {m: why for m, why in wanted.items() if why}
        if missing:
            raise IsolationUnavailableError(missing)
        cgroup = f"cgroup-v{probe.cgroup}" if probe.cgroup else "cgroup"
        active = tuple(cgroup if m == "cgroup" else m for m, why in report.items() if not why)
        return active, tuple(f"{m}: {why}" for m, why in problems.items())

    # -- provision ---------------------------------------------------------------------------
    def plan(self, config: SandboxLifecycleConfig) -> Plan:
        cluster = self._bind(config.kubernetes)
        template = build_manifest(
            config,
            sandbox_id="sb-template",
            namespace=cluster.namespace,
            uid=1,
            server=cluster.server_version(),
        )
        return Plan.of(config, template)

    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """A pod from the warm pool or a new one (see the module docstring). ``secrets`` are
        written by the first exec, from its stdin, into 0400 files on the /tmp emptyDir:
        never in the pod spec, its env, a Secret object or etcd."""
        if self._closed:
            raise DriverError("the kubernetes driver was closed")
        validate_secrets(secrets)
        requested = validate_sandbox_id(config.sandbox_id) if config.sandbox_id else None
        report = self.isolation_report(config)
        wanted = {str(m): report.get(m, "unknown mechanism") for m in config.isolation.required}
        missing = {m: why for m, why in wanted.items() if why}
        if missing:
            raise IsolationUnavailableError(missing)
        pick_uid(config)  # a runAsUser with no meaning here fails before anything is made
        plan = self.plan(config)
        box = None
        if config.kubernetes.warm_pool_size and requested is None and config.copy_in is None:
            box = self.pool.take(plan, config.kubernetes.warm_pool_size)
        if box is None:
            box = self.create(plan, requested or new_sandbox_id())
        try:
            self._place_secrets(box, secrets)
        except BaseException:
            self.destroy(self._context(box))
            raise
        return self._context(box)

    def create(self, plan: Plan, sandbox_id: str, *, pool: bool = False) -> Box:
        """A new pod for ``plan``, running and probed (``pool``: a warm pod, not a sandbox
        yet: registered by pod name only)."""
        config = plan.config
        cluster = self._bind(config.kubernetes)
        self.ensure_watch()
        uid = pick_uid(config)
        manifest = build_manifest(
            config,
            sandbox_id=sandbox_id,
            namespace=cluster.namespace,
            uid=uid,
            server=cluster.server_version(),
            owner=self.lease.ref(),
        )
        if pool:
            manifest = warm_manifest(manifest)
        box = Box(sandbox_id, manifest.pod["metadata"]["name"], plan, uid)
        with self._lock:
            if not pool and sandbox_id in self._boxes:
                raise ProvisionError(f"sandbox {sandbox_id} already exists")
            if not pool:
                self._boxes[sandbox_id] = box
            self._by_pod[box.name] = box
        made: list[str] = []
        try:
            self._create_objects(box, manifest, made)
            self.await_running(box, config.kubernetes.start_timeout_s)
            self.probe(box)
            if config.copy_in is not None:
                self._copy_in(box, config.copy_in)
        except BaseException as exc:
            self._undo(box, made)
            if isinstance(exc, ApiError) and exc.status == 409:
                raise ProvisionError(
                    f"sandbox id {sandbox_id} is in use in namespace {cluster.namespace}"
                ) from exc
            keep = (
                ProvisionError,  # CapacityError among them
                ConfigError,  # SecurityConfigError among them
                IsolationUnavailableError,
                ImageUnavailableError,
                DriverUnavailableError,
                SecretError,
            )
            if isinstance(exc, DevsSandboxError) and not isinstance(exc, keep):
                raise ProvisionError(f"cannot provision sandbox {sandbox_id}: {exc}") from exc
            raise
        return box

    def _create_objects(self, box: Box, m: Manifest, made: list[str]) -> None:
        policy = box.plan.policy
        validate_pod_spec(m.pod, policy)
        validate_network_policy(m.network_policy, m.pod, network=policy.network)
        cl = self.cluster
        stored_policy = cl.request(
            "create the sandbox's NetworkPolicy",
            "POST",
            cl.path(POLICIES),
            body=m.network_policy,
            query=STRICT,
        )
        made.append("policy")
        pod = cl.request(
            "create the sandbox's pod", "POST", cl.path(PODS), body=m.pod, query=STRICT
        )
        made.append("pod")
        box.observe(pod)
        # As stored: defaults, admission webhooks, a server dropping what it does not know.
        validate_pod_spec(pod, policy)
        validate_network_policy(stored_policy, pod, network=policy.network)
        # From now on the pod owns its policy (alone: the garbage collector keeps an object
        # while any owner lives), so the policy goes when the pod has gone, whoever owns
        # the pod by then (a warm pod changes owners), and holds as long as it may run.
        owner = {"apiVersion": "v1", "kind": "Pod", "name": box.name, "uid": box.pod_uid}
        cl.request(
            "let the pod own its NetworkPolicy",
            "PATCH",
            cl.path(POLICIES, box.name),
            body=[{"op": "replace", "path": "/metadata/ownerReferences", "value": [owner]}],
            content_type=JSON_PATCH,
        )
        made.append("owned")

    def await_running(self, box: Box, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            box.changed.clear()
            st = box.state
            if st.running:
                return
            if box.gone or st.finished or st.deleting:
                raise ProvisionError(
                    f"pod {box.name} ended before it ran: {st.reason or st.phase} {st.message}"
                )
            if st.start_failure:
                error = ImageUnavailableError if "Image" in st.start_failure else ProvisionError
                raise error(f"pod {box.name} cannot start: {st.start_failure}")
            now = time.monotonic()
            if now >= deadline:
                if st.unschedulable:
                    raise CapacityError(
                        f"no node can run sandbox {box.id} (waited {timeout_s:g} s): "
                        f"{st.unschedulable}",
                        reason=st.unschedulable,
                    )
                raise ProvisionError(
                    f"pod {box.name} did not start within {timeout_s:g} s (phase {st.phase}); "
                    "raise sandbox.kubernetes.startTimeoutS"
                )
            if not box.changed.wait(min(POLL_FALLBACK_S, deadline - now)):
                self.refresh(box)

    def refresh(self, box: Box) -> None:
        """Read the pod now (the watch may lag or be reconnecting)."""
        try:
            pod = self.cluster.request("read the pod", "GET", self.cluster.path(PODS, box.name))
        except ApiError as exc:
            if exc.not_found:
                box.gone = True
            return
        except DevsSandboxError:
            return
        box.observe(pod)

    def probe(self, box: Box) -> None:
        """Learn what the pod offers; without network, wait (3 s at most) until the deny-all
        policy shows from inside (a CNI may apply it a moment after the pod started)."""
        cfg = box.config
        check = not cfg.network and cfg.kubernetes.verify_network_isolation
        out, err, status = self.runner.script(
            box.name, shim.PROBE, ["wait" if check else "skip"], timeout_s=PROBE_TIMEOUT_S
        )
        if status.code != 0:
            raise ProvisionError(
                f"pod {box.name}: the probe exec failed ({status.reason or status.code}: "
                f"{status.message or err.strip()[-300:]})"
            )
        box.probe = ProbeInfo.parse(out)
        box.isolation, box.warnings = self._settle(box.config, box.probe)

    def _undo(self, box: Box, made: list[str]) -> None:
        """Delete what a failed provision made: the pod, and the policy unless the pod
        already owns it (then the garbage collector takes it after the pod)."""
        with self._lock:
            if self._boxes.get(box.id) is box:
                del self._boxes[box.id]
            if self._by_pod.get(box.name) is box:
                del self._by_pod[box.name]
        if made:
            self._delete_objects(box.name, policy="owned" not in made)

    def _delete_objects(self, name: str, *, policy: bool = False) -> list[str]:
        """Delete a sandbox's pod (and, with ``policy``, its NetworkPolicy; otherwise the
        garbage collector deletes the policy once the pod that owns it is gone, so the
        policy holds for as long as any process of the pod may still run). Returns what
        could not go (the reaper retries)."""
        left: list[str] = []
        cl = self.cluster
        targets = [(PODS, "pod")] + ([(POLICIES, "NetworkPolicy")] if policy else [])
        for template, what in targets:
            try:
                cl.request(f"delete {what} {name}", "DELETE", cl.path(template, name))
            except ApiError as exc:
                if not exc.not_found:
                    left.append(f"{what} {name}: {exc}")
            except DevsSandboxError as exc:
                left.append(f"{what} {name}: {exc}")
        if left:
            logger.warning("could not remove %s (the owner lease's reaper will)", "; ".join(left))
        return left

    def _copy_in(self, box: Box, source: Path) -> None:
        if not source.is_dir():
            raise ProvisionError(f"--copy-in {source}: not a directory")
        with tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024) as spool:
            with tarfile.open(fileobj=spool, mode="w") as tar:
                for entry in sorted(source.iterdir()):
                    tar.add(entry, arcname=entry.name, recursive=True)
            spool.seek(0)
            result = self._run(
                box, ExecRequest(("tar", "-x", "-o", "-f", "-", "-C", WORKSPACE)), stdin_file=spool
            )
        if result.exit_code != 0:
            raise ProvisionError(
                f"--copy-in {source}: tar in the pod exited {result.exit_code} (more than "
                f"quotas.diskBytes? no tar in the image?): {result.stderr.text.strip()[-300:]}"
            )

    def _place_secrets(self, box: Box, secrets: Mapping[str, bytes | bytearray] | None) -> None:
        if not secrets:
            return
        box.secrets = {name: bytearray(value) for name, value in secrets.items()}
        box.redactor = Redactor(box.secrets)
        box.secret_env = {f"{n}_FILE": f"{shim.SECRETS_DIR}/{n}" for n in box.secrets}
        box.secrets_pending = True

    def _context(self, box: Box) -> SandboxContext:
        cl = self.cluster
        labels = {
            "pod": box.name,
            "namespace": cl.namespace,
            "uid": str(box.uid),
            "image": image_of(box.config),
            "workspace_in_pod": WORKSPACE,
        }
        return SandboxContext(
            id=box.id,
            driver=self.name,
            workspace=Path(WORKSPACE),
            isolation=box.isolation,
            labels=labels,
            warnings=box.warnings,
        )

    def adopt(self, box: Box) -> None:
        """Register a claimed warm pod as a sandbox."""
        with self._lock:
            self._boxes[box.id] = box
            self._by_pod[box.name] = box

    def forget_pod(self, name: str) -> None:
        with self._lock:
            box = self._by_pod.get(name)
            if box is not None and self._boxes.get(box.id) is not box:
                del self._by_pod[name]

    # -- exec ---------------------------------------------------------------------------------
    def _box(self, ctx: SandboxContext) -> Box:
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None:
            raise SandboxNotFoundError(ctx.id)
        return box

    def _why_dead(self, box: Box) -> str:
        st = box.state
        return "its pod was deleted" if box.gone else f"its pod ended: {st.reason} {st.message}"

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult:
        box = self._box(ctx)
        if box.dead:
            raise SandboxNotFoundError(box.id, self._why_dead(box))
        return self._run(box, request.replace(env={**box.secret_env, **request.env}))

    def _run(
        self, box: Box, request: ExecRequest, *, stdin_file: IO[bytes] | None = None
    ) -> ExecResult:
        cap = (
            box.config.max_output_bytes
            if request.max_output_bytes is None
            else (request.max_output_bytes)
        )
        header_secrets = self._take_secrets(box)
        holding = header_secrets is not None
        try:
            try:
                outcome = self.runner.command(
                    box, request, cap=cap, header_secrets=header_secrets, stdin_file=stdin_file
                )
            except HandshakeError as exc:
                self.refresh(box)
                if box.dead:
                    raise SandboxNotFoundError(box.id, self._why_dead(box)) from exc
                raise DriverError(f"sandbox {box.id}: {exc}") from exc
            if header_secrets is not None:
                if outcome.status.code == 125 and SECRET_FAILURE in outcome.io.stderr.text:
                    raise SecretError(f"sandbox {box.id}: the secrets could not be written")
                box.secrets_pending = False
        finally:
            if holding:
                box.secrets_lock.release()
        status, io = outcome.status, outcome.io
        if status.code is not None:
            code = status.code
        elif io.killed:
            code = 137  # our kill; its supervisor's status did not make it back in time
            if not io.exited:
                logger.error("sandbox %s: a killed exec did not end in time", box.id)
        else:
            self.refresh(box)
            if not box.dead:
                with contextlib.suppress(DevsSandboxError):
                    self.runner.kill_exec(box, outcome.nonce)
                raise ExecLostError(
                    f"sandbox {box.id}: lost the exec ({status.reason}: {status.message}); "
                    "its processes were killed"
                )
            code = 137  # the pod died under the command: the watch and metrics say why
        last = box.last
        return ExecResult(
            exit_code=code,
            stdout=io.stdout,
            stderr=io.stderr,
            duration_s=io.duration_s,
            timed_out=io.timed_out,
            idle_timed_out=io.idle_timed_out,
            signal=_signal_of(code),
            resources=ResourceUsage(
                cpu_time_s=None,
                peak_memory_bytes=None if last is None else last.peak_memory_bytes,
                peak_processes=max(box.peak_processes, 1),
                wall_time_s=io.duration_s,
            ),
        )

    def _take_secrets(self, box: Box) -> dict[str, bytearray] | None:
        """The secrets this exec's header must write (then ``box.secrets_lock`` is held
        until the exec ends: a concurrent exec waits for them), else None."""
        if not box.secrets_pending:
            return None
        box.secrets_lock.acquire()
        if not _pending(box):  # another exec wrote them while we waited
            box.secrets_lock.release()
            return None
        if any(b"\0" in v for v in box.secrets.values()):
            try:
                box.secrets_pending = False
                self._write_secret_files(box)
            finally:
                box.secrets_lock.release()
            return None
        return box.secrets

    def _write_secret_files(self, box: Box) -> None:
        """Secrets a shell string cannot hold (NUL): one exec each, the value on stdin."""
        for name, value in box.secrets.items():
            argv = ("/bin/sh", "-c", shim.secret_writer(name), "devs-sandbox-secret")
            result = self._run(box, ExecRequest(argv, stdin=bytes(value)))
            if result.exit_code != 0:
                raise SecretError(
                    f"cannot deliver secret {name} into the pod (exit {result.exit_code}): "
                    f"{result.stderr.text.strip()[-200:]}"
                )

    # -- observe / stop -----------------------------------------------------------------------
    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        box = self._box(ctx)
        fresh: Sample | None = None
        if not box.dead and box.probe is not None:
            budget = f"{box.config.quotas.depth_scan_budget_ms / 1000:.3f}"
            find = "1" if box.probe.find_printf else "0"
            try:
                out, _, status = self.runner.script(
                    box.name, shim.SAMPLE, [find, budget], timeout_s=SAMPLE_TIMEOUT_S
                )
                if status.code == 0:
                    fresh = box.last = parse_sample(out)
            except HandshakeError:
                self.refresh(box)
            except DevsSandboxError as exc:
                logger.debug("sampling sandbox %s failed: %s", box.id, exc)
        alive = not box.dead
        s = fresh or box.last or Sample()
        procs = s.task_processes if fresh is not None else None
        if procs is not None:
            box.peak_processes = max(box.peak_processes, procs)
        counted = s.oom_kills
        oom = None if counted is None and not box.oom_events else max(counted or 0, box.oom_events)
        return SandboxMetrics(
            sandbox_id=box.id,
            timestamp=time.monotonic(),
            process_count=procs if alive else 0,
            memory_bytes=s.memory_bytes if alive else None,
            peak_memory_bytes=s.peak_memory_bytes,
            cpu_time_s=s.cpu_time_s,
            file_count=s.file_count,
            directory_depth=s.directory_depth,
            largest_file_bytes=s.largest_file_bytes,
            disk_bytes=s.disk_bytes,
            inodes_free=s.inodes_free,
            disk_free_bytes=0 if box.disk_full else s.disk_free_bytes,
            pids_limit_hits=None,
            oom_kills=oom,
            running=alive,
        )

    def is_running(self, ctx: SandboxContext) -> bool:
        with self._lock:
            box = self._boxes.get(ctx.id)
        return box is not None and not box.dead

    def force_stop(self, ctx: SandboxContext) -> None:
        """SIGKILL every task process (``kill -KILL -1`` as the sandbox's uid); pid 1 and the
        pod stay for inspection. If that exec cannot run, the pod is deleted instead."""
        with self._lock:
            box = self._boxes.get(ctx.id)
        if box is None or box.dead:
            return
        box.stopped = True
        ok = False
        try:
            _, _, status = self.runner.script(
                box.name, shim.FORCE_STOP, timeout_s=FORCE_STOP_TIMEOUT_S
            )
            ok = status.code == 0
        except DevsSandboxError as exc:
            logger.warning("sandbox %s: force stop exec failed: %s", box.id, exc)
        if not ok:
            self.refresh(box)
            if not box.dead:
                logger.error("sandbox %s: could not kill its processes; deleting its pod", box.id)
                with contextlib.suppress(DevsSandboxError):
                    self.cluster.request(
                        "delete the pod",
                        "DELETE",
                        self.cluster.path(PODS, box.name),
                        body={"gracePeriodSeconds": 0},
                    )

    def destroy(self, ctx: SandboxContext) -> None:
        with self._lock:
            box = self._boxes.pop(ctx.id, None)
            if box is not None and self._by_pod.get(box.name) is box:
                del self._by_pod[box.name]
        if box is None:
            try:
                self._delete_objects(ctx.labels.get("pod") or pod_name(ctx.id))
            except DevsSandboxError as exc:
                logger.warning("sandbox %s: %s", ctx.id, exc)
            return
        wipe(box.secrets.values())
        box.secrets.clear()
        self._delete_objects(box.name)

    def reap_orphans(self) -> list[str]:
        """Delete pods and policies whose owner Lease expired or is gone, and other owners'
        finished pods; never a live owner's. Returns the sandbox ids reaped."""
        try:
            cluster = self._bind(self.settings)
            with self._lock:
                mine = set(self._by_pod) | self.pool.names()
            return reap(cluster, mine=mine, own_lease=self.lease.name)
        except DevsSandboxError as exc:
            logger.debug("no kubernetes orphans reaped: %s", exc)
            return []

    # -- optional capabilities ----------------------------------------------------------------
    def member_pids(self, ctx: SandboxContext) -> list[int]:
        return []  # processes of a pod have no pids on this host

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        return None  # the image decides, and we do not pull it here

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        return None

    def close(self) -> None:
        """Drop the warm pool, stop the watch, delete the owner Lease."""
        if self._closed:
            return
        self._closed = True
        self.pool.close()
        if self._watcher is not None:
            self._watcher.stop()
        if self._lease is not None:
            self._lease.release()
        if self._cluster is not None:
            self._cluster.close()

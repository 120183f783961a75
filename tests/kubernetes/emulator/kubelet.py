"""A test-only kubelet (and scheduler): pods in the emulator become containers on Docker.

It is a client of the emulated API server like a real kubelet: it watches pods with the
official client, binds unscheduled ones to its node (``pods/binding``, the scheduler's
job), runs each bound pod as one Docker container, reports the pod's status through
``pods/status``, and finishes a graceful deletion with a zero-grace delete. The API server
sends it the exec and log requests of its pods (``ApiServer.register_node``).

How a pod maps to a container (what a real kubelet with runc does, as far as Docker can):
- image: ``image_map[image]``, else ``image_map["*"]``; none -> waiting ``ErrImagePull``;
- command -> entrypoint, args -> cmd (a command without args drops the image's cmd);
- securityContext (pod, then container): runAsUser/runAsGroup -> user, runAsNonRoot checked
  against the effective uid (``CreateContainerConfigError`` as in kuberuntime), fsGroup and
  supplementalGroups -> extra groups, readOnlyRootFilesystem -> read-only rootfs, capabilities
  -> cap_drop/cap_add, allowPrivilegeEscalation false -> no-new-privileges, seccompProfile
  RuntimeDefault -> Docker's default profile; unset or Unconfined -> ``seccomp=unconfined``
  (the kubelet's default without SeccompDefault);
- resources.limits: memory -> mem_limit with memswap equal (no swap), cpu -> nano_cpus;
  requests are the scheduler's business and are ignored; no pids field exists on a pod, the
  node-wide ``pod_pids_limit`` (kubelet podPidsLimit) applies to every container;
- emptyDir medium Memory -> tmpfs sized sizeLimit (else the pod's memory limit, as with
  SizeMemoryBackedVolumes), exec, writable by the pod's runAsUser; other emptyDirs -> an
  anonymous volume (sizeLimit not enforced);
- activeDeadlineSeconds -> the container is stopped and the pod Failed/DeadlineExceeded;
- network: Docker's bridge, disconnected (only loopback left, as ``network_mode=none``)
  while a NetworkPolicy in the pod's namespace selects it and allows no egress; re-checked
  when policies change.

Refused (pod Failed, reason ``Unsupported``): hostNetwork, hostPID, hostIPC, privileged,
more than one container or init containers, volumes other than emptyDir, subPath,
restartPolicy other than Never. Status follows Docker: running, then terminated with
``OOMKilled`` (Docker's State.OOMKilled with exit 137, i.e. pid 1 was killed), ``Completed``
or ``Error``. An exec'd process killed by the OOM killer exits 137 in its exec and leaves the
pod status alone, as on a cgroup v1 node.

Every container carries ``devs.test.kubelet=1``, this kubelet's session label and the pod's
namespace/name/uid (``io.kubernetes.pod.*``, as dockershim labelled them), so ``stop()``
removes all it made; the owning process's pid and start time too, so ``reap_orphans`` can
remove what a crashed or interrupted session left without touching a live one's.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .selectors import label_selector
from .server import ApiServer
from .validation import quantity

logger = logging.getLogger(__name__)

LABEL = "devs.test.kubelet"
SESSION_LABEL = "devs.test.kubelet.session"
OWNER_PID_LABEL = "devs.test.kubelet.owner-pid"
OWNER_START_LABEL = "devs.test.kubelet.owner-start"  # the owner's start time: pids are reused
POD_NS_LABEL = "io.kubernetes.pod.namespace"
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_UID_LABEL = "io.kubernetes.pod.uid"
DEADLINE_POLL_S = 0.2  # how late an activeDeadlineSeconds may fire
WATCH_TIMEOUT_S = 10  # a watch is renewed (from its last resourceVersion) this often
EXIT_CODE_WAIT_S = 5.0  # docker sets an exec's ExitCode moments after its output ends
REMOVE_TIMEOUT_S = 30  # docker rm -f of a container that ignores signals
STOP_JOIN_S = 3.0  # a watch thread cut short by Watch.stop() ends at once
WORKERS = 4  # pods started/stopped in parallel
OCI_EXEC_FAILURE = b"OCI runtime exec failed"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RefusedError(Exception):
    """The pod asks for something this test kubelet will not do on the host."""


class ConfigError(Exception):
    """kuberuntime's CreateContainerConfigError (e.g. runAsNonRoot with a root user)."""


@dataclass
class _Pod:
    namespace: str
    name: str
    uid: str
    container_name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    container_id: str | None = None
    started_mono: float | None = None
    deadline_s: int | None = None
    deadline_exceeded: bool = False
    finished: bool = False
    deleting: bool = False
    isolated: bool = False  # disconnected from the bridge by a deny-all NetworkPolicy


class DockerExec:
    """One ``docker exec`` bridged to the emulator's exec protocol (server.ExecSession)."""

    def __init__(
        self, engine: Any, container_id: str, command: list[str], *, stdin: bool, tty: bool
    ) -> None:
        self._api = engine.api
        self._tty = tty
        self._exec_id = self._api.exec_create(
            container_id, command, stdin=stdin, stdout=True, stderr=True, tty=tty
        )["Id"]
        self._sock = self._api.exec_start(self._exec_id, socket=True, tty=tty)._sock
        self._sock.settimeout(None)  # the SDK's request timeout must not end a quiet exec
        self._buf = b""
        self._first = True
        self._error: str | None = None
        self._closed = False

    def _recv(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read(self) -> tuple[int, bytes] | None:
        if self._tty:
            data = self._buf or self._recv_any()
            self._buf = b""
            return (1, data) if data else None
        header = self._recv(8)
        if header is None:
            return None
        stream, size = header[0], struct.unpack(">I", header[4:])[0]
        data = self._recv(size) or b""
        if self._first:
            self._first = False
            # runc's failure to start the command arrives as output; a kubelet reports it
            # as an error status (exec.go: "error executing command in container").
            if data.startswith(OCI_EXEC_FAILURE):
                self._error = data.decode(errors="replace").strip()
                return self.read()
        return (2 if stream == 2 else 1, data)

    def _recv_any(self) -> bytes:
        try:
            return self._sock.recv(65536)
        except OSError:
            return b""

    def write_stdin(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def resize(self, width: int, height: int) -> None:
        self._api.exec_resize(self._exec_id, height=height, width=width)

    def exit_code(self) -> int | None:
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while True:
            info = self._api.exec_inspect(self._exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                self.detach()
                return int(info["ExitCode"])
            if time.monotonic() > deadline:
                self.detach()
                return None
            time.sleep(0.01)

    def error(self) -> str | None:
        return self._error

    def detach(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.close()


class Kubelet:
    """Runs the pods of one emulated node on the local Docker engine."""

    def __init__(
        self,
        emulator: ApiServer,
        api_client: Any,
        engine: Any,
        *,
        image_map: dict[str, str],
        node_name: str = "devs-test-node",
        pod_pids_limit: int | None = None,
        session: str | None = None,
    ) -> None:
        from kubernetes import client

        self.emulator = emulator
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.engine = engine
        self.image_map = dict(image_map)
        self.node_name = node_name
        self.pod_pids_limit = pod_pids_limit
        self.session = session or uuid.uuid4().hex[:12]
        self.labels = {LABEL: "1", SESSION_LABEL: self.session, **_owner_labels()}
        self.errors: list[str] = []  # failures of the kubelet itself (a test should see none)
        self._pods: dict[str, _Pod] = {}
        self._pods_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kubelet")
        self._threads: list[threading.Thread] = []
        self._events: Any = None
        self._policies: list[dict[str, Any]] = []
        self._watches: list[Any] = []

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> Kubelet:
        self.emulator.register_node(self.node_name, self)
        self._events = self.engine.events(
            decode=True,
            filters={
                "type": "container",
                "label": [f"{SESSION_LABEL}={self.session}"],
                "event": ["die"],
            },
        )
        for target, name in (
            (self._watch_pods, "kubelet-pods"),
            (self._watch_policies, "kubelet-netpol"),
            (self._docker_events, "kubelet-docker"),
            (self._deadlines, "kubelet-deadlines"),
        ):
            t = threading.Thread(target=self._guard(target), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.emulator.unregister_node(self.node_name)
        with contextlib.suppress(Exception):
            self._events.close()
        for w in list(self._watches):
            with contextlib.suppress(Exception):
                w.stop()
            with contextlib.suppress(Exception):  # a blocked read ends now, not at its timeout
                w._resp.shutdown()
        self.remove_all()  # first: a worker waiting out a grace period returns at once
        self._pool.shutdown(wait=True, cancel_futures=True)
        for t in self._threads:
            # A watch caught between its list and its stream ends with the emulator's
            # shutdown; the threads check _stop before touching Docker again.
            t.join(STOP_JOIN_S)
        self.remove_all()

    def remove_all(self) -> int:
        """Remove every container this kubelet made (by its session label)."""
        found = self.engine.api.containers(
            all=True, filters={"label": f"{SESSION_LABEL}={self.session}"}
        )
        for c in found:
            with contextlib.suppress(Exception):
                self.engine.api.remove_container(c["Id"], force=True, v=True)
        return len(found)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    fn()
                    return
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    logger.exception("kubelet loop %s failed; restarting", fn.__name__)
                    self.errors.append(f"{fn.__name__}: {exc!r}")
                    time.sleep(0.2)

        return run

    # -- watching the API -----------------------------------------------------------------
    def _watch_pods(self) -> None:
        from kubernetes import client, watch

        rv: str | None = None
        while not self._stop.is_set():
            if rv is None:
                listed = self.core.list_pod_for_all_namespaces()
                for pod in listed.items:
                    self._on_pod("ADDED", self.core.api_client.sanitize_for_serialization(pod))
                rv = listed.metadata.resource_version
            w = self._watch_object(watch.Watch())
            if self._stop.is_set():  # stop() may have closed the watches before this one
                return
            try:
                # With timeout_seconds the client raises a 410 ERROR event as ApiException.
                for event in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=rv,
                    timeout_seconds=WATCH_TIMEOUT_S,
                ):
                    if self._stop.is_set():
                        w.stop()
                        return
                    obj = event["raw_object"]
                    rv = obj["metadata"]["resourceVersion"]
                    self._on_pod(event["type"], obj)
            except client.ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                raise

    def _watch_policies(self) -> None:
        from kubernetes import client, watch

        while not self._stop.is_set():
            listed = self.net.list_network_policy_for_all_namespaces()
            self._policies = [
                self.net.api_client.sanitize_for_serialization(p) for p in listed.items
            ]
            self._reconcile_network()
            w = self._watch_object(watch.Watch())
            if self._stop.is_set():  # stop() may have closed the watches before this one
                return
            try:
                for _event in w.stream(
                    self.net.list_network_policy_for_all_namespaces,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=WATCH_TIMEOUT_S,
                ):
                    break  # any change: list again and re-evaluate every pod
            except client.ApiException as exc:
                if exc.status != 410:
                    raise

    def _watch_object(self, w: Any) -> Any:
        """Remember an open watch so that stop() can cut it short."""
        with self._pods_lock:
            self._watches = [*[x for x in self._watches if x is not w][-4:], w]
        if self._stop.is_set():
            w.stop()
        return w

    def _on_pod(self, event_type: str, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        uid = meta["uid"]
        if event_type == "DELETED":
            state = self._pods.get(uid)
            if state is not None:
                self._pool.submit(self._guarded(self._remove), state)
            return
        node = spec.get("nodeName")
        if not node:
            if not meta.get("deletionTimestamp"):
                self._pool.submit(self._guarded(self._bind), pod)
            return
        if node != self.node_name:
            return
        with self._pods_lock:
            state = self._pods.get(uid)
            if state is None:
                containers = spec.get("containers") or [{}]
                state = _Pod(
                    meta.get("namespace", ""), meta["name"], uid, containers[0].get("name", "")
                )
                self._pods[uid] = state
                new = True
            else:
                new = False
        state.deadline_s = spec.get("activeDeadlineSeconds")
        if meta.get("deletionTimestamp") and not state.deleting:
            state.deleting = True
            self._pool.submit(
                self._guarded(self._terminate),
                state,
                int(meta.get("deletionGracePeriodSeconds") or 0),
            )
        elif new and not meta.get("deletionTimestamp"):
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                state.finished = True  # a restart of the kubelet must not rerun it
            else:
                self._pool.submit(self._guarded(self._run), state, pod)

    def _guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                if not self._stop.is_set():
                    logger.exception("kubelet %s failed", fn.__name__)
                    self.errors.append(f"{fn.__name__}: {exc!r}")

        return run

    def _bind(self, pod: dict[str, Any]) -> None:
        from kubernetes import client

        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod["metadata"]["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        try:
            # _preload_content=False: the client cannot deserialise the Status a binding
            # returns into V1Binding (kubernetes-client/python issue #825).
            self.core.create_namespaced_pod_binding(
                pod["metadata"]["name"], pod["metadata"]["namespace"], body, _preload_content=False
            )
        except client.ApiException as exc:
            if exc.status not in (404, 409):
                raise

    # -- pod status -----------------------------------------------------------------------
    def _patch_status(self, state: _Pod, status: dict[str, Any]) -> None:
        from kubernetes import client

        try:
            self.core.patch_namespaced_pod_status(state.name, state.namespace, {"status": status})
        except client.ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                raise

    def _conditions(self, ready: bool, reason: str | None = None) -> list[dict[str, Any]]:
        now = _now()
        out = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]
        out.append({"type": "Initialized", "status": "True", "lastTransitionTime": now})
        for kind in ("ContainersReady", "Ready"):
            cond: dict[str, Any] = {
                "type": kind,
                "status": "True" if ready else "False",
                "lastTransitionTime": now,
            }
            if reason:
                cond["reason"] = reason
            out.append(cond)
        return out

    def _fail(self, state: _Pod, reason: str, message: str) -> None:
        state.finished = True
        self._patch_status(
            state,
            {
                "phase": "Failed",
                "reason": reason,
                "message": message,
                "conditions": self._conditions(False, "PodFailed"),
            },
        )

    def _waiting(self, state: _Pod, image: str, reason: str, message: str) -> None:
        self._patch_status(
            state,
            {
                "phase": "Pending",
                "hostIP": "127.0.0.1",
                "startTime": _now(),
                "conditions": self._conditions(False, "ContainersNotReady"),
                "containerStatuses": [
                    {
                        "name": state.container_name,
                        "image": image,
                        "imageID": "",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": reason, "message": message}},
                    }
                ],
            },
        )

    # -- running a pod --------------------------------------------------------------------
    def _run(self, state: _Pod, pod: dict[str, Any]) -> None:
        spec = pod["spec"]
        container = (spec.get("containers") or [{}])[0]
        image = container.get("image", "")
        with state.lock:
            if state.deleting or self._stop.is_set():
                return
            state.started_mono = time.monotonic()
            try:
                self._refuse(spec)
            except RefusedError as exc:
                self._fail(state, "Unsupported", f"the test kubelet refuses this pod: {exc}")
                return
            local = self.image_map.get(image) or self.image_map.get("*")
            if not local:
                self._waiting(
                    state, image, "ErrImagePull", f'image "{image}" is not mapped to a local image'
                )
                return
            self._waiting(state, image, "ContainerCreating", "")
            try:
                create = self._container_config(pod, local)
            except ConfigError as exc:
                self._waiting(state, image, "CreateContainerConfigError", str(exc))
                return
            ctr = self.engine.api.create_container(**create)
            state.container_id = ctr["Id"]
            if self._denied(pod):
                self.engine.api.disconnect_container_from_network(state.container_id, "bridge")
                state.isolated = True
            self.engine.api.start(state.container_id)
            info = self.engine.api.inspect_container(state.container_id)
            if not info["State"]["Running"]:
                return  # died at once: the die event reports it
            ip = info["NetworkSettings"].get("IPAddress") or ""
            self._patch_status(
                state,
                {
                    "phase": "Running",
                    "hostIP": "127.0.0.1",
                    "podIP": ip,
                    "podIPs": [{"ip": ip}] if ip else [],
                    "conditions": self._conditions(True),
                    "containerStatuses": [
                        {
                            "name": state.container_name,
                            "image": image,
                            "imageID": f"docker-pullable://{info['Image']}",
                            "containerID": f"docker://{state.container_id}",
                            "ready": True,
                            "started": True,
                            "restartCount": 0,
                            "state": {
                                "running": {"startedAt": info["State"]["StartedAt"][:19] + "Z"}
                            },
                        }
                    ],
                },
            )

    @staticmethod
    def _refuse(spec: dict[str, Any]) -> None:
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                raise RefusedError(f"{key} shares the host's namespaces")
        if len(spec.get("containers") or []) != 1 or spec.get("initContainers"):
            raise RefusedError("it runs exactly one container and no init containers")
        if spec.get("restartPolicy", "Always") != "Never":
            raise RefusedError("it only runs pods with restartPolicy Never")
        sc = spec["containers"][0].get("securityContext") or {}
        if sc.get("privileged"):
            raise RefusedError("privileged containers")
        for vol in spec.get("volumes") or []:
            if set(vol) - {"name", "emptyDir"}:
                raise RefusedError(f"volume {vol.get('name')}: only emptyDir volumes are supported")
        for mount in spec["containers"][0].get("volumeMounts") or []:
            if mount.get("subPath") or mount.get("subPathExpr"):
                raise RefusedError("subPath mounts")

    def _container_config(self, pod: dict[str, Any], image: str) -> dict[str, Any]:
        meta, spec = pod["metadata"], pod["spec"]
        c = spec["containers"][0]
        psc = spec.get("securityContext") or {}
        csc = c.get("securityContext") or {}

        def pick(key: str) -> Any:
            return csc.get(key, psc.get(key))

        image_user = (self.engine.api.inspect_image(image).get("Config") or {}).get("User") or ""
        uid, gid = pick("runAsUser"), pick("runAsGroup")
        user = None
        if uid is not None:
            user = f"{uid}:{gid}" if gid is not None else str(uid)
        elif gid is not None:
            user = f"{image_user.split(':')[0] or 0}:{gid}"
        if pick("runAsNonRoot"):
            effective = str(uid) if uid is not None else image_user.split(":")[0]
            where = (
                f'pod: "{meta["name"]}_{meta.get("namespace")}({meta["uid"]})", '
                f"container: {c['name']}"
            )
            if effective in ("", "0", "root"):
                raise ConfigError(
                    f"container has runAsNonRoot and image will run as root ({where})"
                )
            if not effective.isdigit():
                raise ConfigError(
                    f"container has runAsNonRoot and image has non-numeric user "
                    f"({effective}), cannot verify user is non-root ({where})"
                )
        groups = [str(g) for g in psc.get("supplementalGroups") or []]
        if psc.get("fsGroup") is not None:
            groups.append(str(psc["fsGroup"]))
        caps = csc.get("capabilities") or {}
        security_opt = []
        if pick("allowPrivilegeEscalation") is False:
            security_opt.append("no-new-privileges")
        seccomp = (pick("seccompProfile") or {}).get("type", "Unconfined")
        if seccomp == "Unconfined":
            security_opt.append("seccomp=unconfined")
        elif seccomp != "RuntimeDefault":
            raise ConfigError(
                f"seccomp profile type {seccomp} is not supported by the test kubelet"
            )
        limits = (c.get("resources") or {}).get("limits") or {}
        mem = int(quantity(limits["memory"])) if "memory" in limits else None
        cpu = int(quantity(limits["cpu"]) * 1_000_000_000) if "cpu" in limits else None

        volumes = {v["name"]: v.get("emptyDir") or {} for v in spec.get("volumes") or []}
        tmpfs: dict[str, str] = {}
        mounts: list[Any] = []
        from docker.types import Mount

        for vm in c.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise ConfigError(f"volume {vm['name']} is not declared in the pod")
            empty_dir = volumes[vm["name"]]
            if empty_dir.get("medium") == "Memory":
                size = int(quantity(empty_dir["sizeLimit"])) if empty_dir.get("sizeLimit") else mem
                # A kubelet's emptyDir is 0777 and not noexec; Docker adds noexec to a tmpfs
                # and copies the mode of an image directory it is mounted over (the image's
                # /workspace is 0755 root), so the pod's uid is made its owner instead.
                opts = ["mode=0777", "exec"]
                if size:
                    opts.insert(0, f"size={size}")
                if vm.get("readOnly"):
                    opts.append("ro")
                if uid is not None:
                    opts.append(f"uid={uid}")
                if psc.get("fsGroup") is not None:
                    opts.append(f"gid={psc['fsGroup']}")
                tmpfs[vm["mountPath"]] = ",".join(opts)
            else:
                mounts.append(
                    Mount(
                        target=vm["mountPath"],
                        source=None,
                        type="volume",
                        read_only=bool(vm.get("readOnly")),
                    )
                )
        host_config = self.engine.api.create_host_config(
            mem_limit=mem,
            memswap_limit=mem,
            nano_cpus=cpu,
            pids_limit=self.pod_pids_limit,
            read_only=bool(pick("readOnlyRootFilesystem")),
            cap_drop=caps.get("drop"),
            cap_add=caps.get("add"),
            security_opt=security_opt or None,
            tmpfs=tmpfs or None,
            mounts=mounts or None,
            group_add=groups or None,
            network_mode="bridge",
            init=False,
        )
        env = {}
        for item in c.get("env") or []:
            if "valueFrom" in item:
                raise ConfigError(
                    f"env {item['name']}: valueFrom is not supported by the test kubelet"
                )
            env[item["name"]] = item.get("value", "")
        labels = {
            **self.labels,
            POD_NS_LABEL: meta.get("namespace", ""),
            POD_NAME_LABEL: meta["name"],
            POD_UID_LABEL: meta["uid"],
        }
        return {
            "image": image,
            "entrypoint": c.get("command"),
            "command": c.get("args"),
            "user": user,
            "environment": env,
            "working_dir": c.get("workingDir"),
            "hostname": meta["name"][:63],
            "labels": labels,
            "host_config": host_config,
            "stdin_open": bool(c.get("stdin")),
            "tty": bool(c.get("tty")),
        }

    # -- network policies -----------------------------------------------------------------
    def _denied(self, pod: dict[str, Any]) -> bool:
        """Is the pod selected by a policy of its namespace that allows it no egress?"""
        ns = pod["metadata"].get("namespace")
        for policy in self._policies:
            if policy["metadata"].get("namespace") != ns:
                continue
            spec = policy.get("spec") or {}
            selector = spec.get("podSelector") or {}
            if not _selects(selector, pod):
                continue
            types = spec.get("policyTypes") or (
                ["Ingress", "Egress"] if spec.get("egress") is not None else ["Ingress"]
            )
            if "Egress" in types and not spec.get("egress"):
                return True
        return False

    def _reconcile_network(self) -> None:
        import docker.errors

        from kubernetes import client

        for state in list(self._pods.values()):
            # Under the pod's lock: _run may be starting (and disconnecting) it right now.
            with state.lock:
                if state.container_id is None or state.finished or state.deleting:
                    continue
                try:
                    pod = self.core.api_client.sanitize_for_serialization(
                        self.core.read_namespaced_pod(state.name, state.namespace)
                    )
                    deny = self._denied(pod)
                    if deny and not state.isolated:
                        self.engine.api.disconnect_container_from_network(
                            state.container_id, "bridge"
                        )
                        state.isolated = True
                    elif not deny and state.isolated:
                        self.engine.api.connect_container_to_network(state.container_id, "bridge")
                        state.isolated = False
                except client.ApiException as exc:
                    if exc.status != 404 and not self._stop.is_set():  # 404: deleted meanwhile
                        self.errors.append(f"network of {state.name}: {exc!r}")
                except docker.errors.NotFound:
                    pass  # the container went with its pod meanwhile
                except Exception as exc:
                    if not self._stop.is_set():
                        self.errors.append(f"network of {state.name}: {exc!r}")

    # -- container ends -------------------------------------------------------------------
    def _docker_events(self) -> None:
        for event in self._events:
            if self._stop.is_set():
                return
            if event.get("status") != "die" and event.get("Action") != "die":
                continue
            uid = ((event.get("Actor") or {}).get("Attributes") or {}).get(POD_UID_LABEL)
            state = self._pods.get(uid or "")
            if state is not None:
                self._pool.submit(self._guarded(self._report_exit), state)

    def _report_exit(self, state: _Pod) -> None:
        with state.lock:
            if state.container_id is None or state.finished or state.deleting:
                return
            info = self.engine.api.inspect_container(state.container_id)
            st = info["State"]
            if st["Running"]:
                return
            state.finished = True
            code = int(st["ExitCode"])
            reason = (
                "OOMKilled"
                if st.get("OOMKilled") and code == 137
                else "Completed"
                if code == 0
                else "Error"
            )
            terminated = {
                "exitCode": code,
                "reason": reason,
                "startedAt": st["StartedAt"][:19] + "Z",
                "finishedAt": st["FinishedAt"][:19] + "Z",
                "containerID": f"docker://{state.container_id}",
            }
            status: dict[str, Any] = {
                "phase": "Succeeded" if code == 0 and not state.deadline_exceeded else "Failed",
                "conditions": self._conditions(False, "PodCompleted"),
                "containerStatuses": [
                    {
                        "name": state.container_name,
                        "image": (info.get("Config") or {}).get("Image", ""),
                        "imageID": f"docker-pullable://{info['Image']}",
                        "containerID": f"docker://{state.container_id}",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {"terminated": terminated},
                    }
                ],
            }
            if state.deadline_exceeded:
                status["reason"] = "DeadlineExceeded"
                status["message"] = "Pod was active on the node longer than the specified deadline"
            self._patch_status(state, status)

    def _deadlines(self) -> None:
        while not self._stop.wait(DEADLINE_POLL_S):
            now = time.monotonic()
            for state in list(self._pods.values()):
                if (
                    state.deadline_s is None
                    or state.started_mono is None
                    or state.finished
                    or state.deleting
                    or state.deadline_exceeded
                ):
                    continue
                if now - state.started_mono >= state.deadline_s:
                    state.deadline_exceeded = True
                    self._pool.submit(self._guarded(self._kill_for_deadline), state)

    def _kill_for_deadline(self, state: _Pod) -> None:
        if state.container_id is None:
            with state.lock:
                self._fail(
                    state,
                    "DeadlineExceeded",
                    "Pod was active on the node longer than the specified deadline",
                )
            return
        with contextlib.suppress(Exception):
            self.engine.api.kill(state.container_id)
        # the die event reports it with the DeadlineExceeded reason

    # -- deletion -------------------------------------------------------------------------
    def _terminate(self, state: _Pod, grace_s: int) -> None:
        """A graceful deletion: stop with the grace period, then confirm with grace 0."""
        from kubernetes import client

        with state.lock:
            if state.container_id is not None:
                with contextlib.suppress(Exception):
                    self.engine.api.stop(state.container_id, timeout=grace_s)
                with contextlib.suppress(Exception):
                    self.engine.api.remove_container(state.container_id, force=True, v=True)
            state.finished = True
        try:
            self.core.delete_namespaced_pod(
                state.name,
                state.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=state.uid)
                ),
            )
        except client.ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _remove(self, state: _Pod) -> None:
        with state.lock:
            if state.container_id is not None:
                with contextlib.suppress(Exception):
                    self.engine.api.remove_container(state.container_id, force=True, v=True)
            state.finished = True
        with self._pods_lock:
            self._pods.pop(state.uid, None)

    # -- the node side of exec and logs (server.NodeBackend) ------------------------------
    def _state_of(self, pod: dict[str, Any]) -> _Pod:
        state = self._pods.get(pod["metadata"]["uid"])
        if state is None or state.container_id is None:
            raise RuntimeError(f'container not found ("{pod["metadata"]["name"]}")')
        return state

    def start_exec(
        self, pod: dict[str, Any], container: str, command: list[str], *, stdin: bool, tty: bool
    ) -> DockerExec:
        state = self._state_of(pod)
        return DockerExec(self.engine, state.container_id or "", command, stdin=stdin, tty=tty)

    def logs(self, pod: dict[str, Any], container: str) -> bytes:
        state = self._state_of(pod)
        out: bytes = self.engine.api.logs(state.container_id, stdout=True, stderr=True)
        return out


def _owner_labels() -> dict[str, str]:
    import os

    import psutil

    me = psutil.Process(os.getpid())
    return {OWNER_PID_LABEL: str(me.pid), OWNER_START_LABEL: f"{me.create_time():.3f}"}


def reap_orphans(engine: Any) -> list[str]:
    """Remove test-kubelet containers whose owning process is gone (a test session that
    crashed or was interrupted before its teardown). Live sessions' containers stay."""
    import psutil

    removed = []
    for c in engine.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        labels = c.get("Labels") or {}
        try:
            owner = psutil.Process(int(labels.get(OWNER_PID_LABEL, "0")))
            alive = f"{owner.create_time():.3f}" == labels.get(OWNER_START_LABEL)
        except (ValueError, psutil.Error):
            alive = False
        if not alive:
            with contextlib.suppress(Exception):
                engine.api.remove_container(c["Id"], force=True, v=True)
                removed.append(c["Id"][:12])
    return removed


def _selects(selector: dict[str, Any], pod: dict[str, Any]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a pod's labels."""
    parts = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return bool(label_selector(",".join(parts))(pod))

"""The objects a Kubernetes sandbox is made of, built in one place and checked field by field.

``build_manifest`` turns a sandbox's config into a hardened Pod and the NetworkPolicy that
closes it; ``validate_pod_spec`` and ``validate_network_policy`` raise
``SecurityConfigError`` naming every field that deviates. The driver validates twice: the
objects it is about to send, and the pod the API server stored (defaulted, and possibly
changed by a mutating admission webhook or a server that silently drops a field it does
not know), so no code path, override or cluster can run a sandbox without its hardening.

Pure Python on purpose: ``devs-sandbox kubernetes manifest`` prints these objects without
the ``kubernetes`` package and without a cluster, like ``kubectl create --dry-run=client``.

What the pod is::

    pid 1   /bin/sh -c INIT        reaps orphans, exits at SIGTERM (fast deletion)
    exec    /bin/sh -c SHIM        one per command: limits (ulimit), env, secrets, then the
                                   supervisor (python3, a subreaper) runs the command
    /workspace  Memory emptyDir, sizeLimit = quotas.diskBytes
    /tmp        Memory emptyDir, sizeLimit = kubernetes.tmpBytes (secrets live here)
    /dev/shm    Memory emptyDir, sizeLimit = kubernetes.tmpBytes

Version gates: a field newer than the oldest supported server (1.28) is emitted only for a
server that has it (``GATED_FIELDS``); for an older one its annotation form, if it has one.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Final

from devs_sandbox.errors import ConfigError, SecurityConfigError

if TYPE_CHECKING:
    from devs_sandbox.config import SandboxLifecycleConfig

ServerVersion = tuple[int, int]

OLDEST_SERVER: Final[ServerVersion] = (1, 28)
NEWEST_SCHEMA: Final[ServerVersion] = (1, 37)
CONTAINER: Final = "sandbox"
WORKSPACE: Final = "/workspace"
TMP: Final = "/tmp"
SHM: Final = "/dev/shm"
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NAME_PREFIX: Final = "devs-sandbox-"
INIT_NAME: Final = "devs-sandbox-init"
# pid 1: reaps what the per-exec supervisors leave behind (dash's wait reaps any child),
# and ends at once when the kubelet sends SIGTERM. A task may end its own pod that way.
INIT: Final = "trap 'exit 0' TERM; while :; do sleep 2147483647 & wait $!; done"
TERMINATION_GRACE_S: Final = 1  # pid 1 exits at SIGTERM; the rest dies with it

# -- labels ------------------------------------------------------------------------------
LABEL_MANAGED: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "devs-sandbox"
LABEL_SANDBOX: Final = "devs-sandbox.io/sandbox"  # a label-safe form of the sandbox id
LABEL_OWNER: Final = "devs-sandbox.io/owner"  # name of the owner Lease
LABEL_STATE: Final = "devs-sandbox.io/state"  # active | filling | warm
LABEL_POOL: Final = "devs-sandbox.io/pool"  # configuration shape of a pooled pod
ANN_SANDBOX_ID: Final = "devs-sandbox.io/sandbox-id"  # the exact id
ANN_PROBE: Final = "devs-sandbox.io/probe"  # what the pod's image and node offer (JSON)
ANN_APPARMOR: Final = "container.apparmor.security.beta.kubernetes.io/" + CONTAINER
STATE_ACTIVE: Final = "active"
STATE_FILLING: Final = "filling"
STATE_WARM: Final = "warm"

# Uids of sandboxes: random, so that RLIMIT_NPROC (counted per uid on the node) is each
# sandbox's own. With hostUsers: false the pod's uids must lie in its 0-65535 range.
UID_RANGE: Final = (1_700_000_000, 2_100_000_000)
USERNS_UID_RANGE: Final = (10_000, 65_534)

# Fields absent from the oldest supported schema: (path, first server that has it).
GATED_FIELDS: Final[Mapping[str, ServerVersion]] = {
    "spec.securityContext.appArmorProfile": (1, 30),
}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIX: Final[dict[str, Decimal]] = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def parse_quantity(value: Any) -> Decimal:
    """A resource.Quantity ("64Mi", "500m", "1e3", 67108864) as a number; ValueError if not."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")  # noqa: TRY004 - callers catch ValueError
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"not a quantity: {value!r}") from None
    suffix = m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * _SUFFIX.get(suffix, Decimal(1))


def parse_server_version(major: str, minor: str) -> ServerVersion:
    """``/version``'s major and minor ("1", "33+" on some clouds) as numbers."""
    digits = re.match(r"\d+", minor or "")
    try:
        return int(major), int(digits.group(0)) if digits else 0
    except ValueError:
        return OLDEST_SERVER


def has_field(path: str, server: ServerVersion | None) -> bool:
    """Does a server of this version know ``path``? Unknown version: the oldest supported."""
    return (server or OLDEST_SERVER) >= GATED_FIELDS.get(path, OLDEST_SERVER)


# -- names -------------------------------------------------------------------------------
def sandbox_key(sandbox_id: str) -> str:
    """A label value and DNS label for ``sandbox_id``: the id itself when it already is one
    (``sb-1a2b...``), else a lowercased form with a hash of the exact id, so two ids never
    share a pod."""
    plain = sandbox_id.lower()
    safe = re.sub(r"[^a-z0-9-]", "-", plain).strip("-")
    if safe == sandbox_id and len(safe) <= 50 and _DNS_LABEL.match(safe):
        return safe
    digest = hashlib.sha256(sandbox_id.encode()).hexdigest()[:10]
    return f"{safe[:40].strip('-') or 'x'}-{digest}"


def pod_name(sandbox_id: str) -> str:
    return NAME_PREFIX + sandbox_key(sandbox_id)


def pick_uid(config: SandboxLifecycleConfig) -> int:
    """The sandbox's uid: ``isolation.runAsUser`` when it names one, else random."""
    want = config.isolation.run_as_user
    if isinstance(want, int):
        return want
    if want == "nobody":
        return 65_534
    if want == "current":
        raise ConfigError(
            'isolation.runAsUser "current" has no meaning on a cluster; use "auto" or a uid',
            key="sandbox.isolation.runAsUser",
        )
    lo, hi = UID_RANGE if config.kubernetes.host_users else USERNS_UID_RANGE
    return lo + secrets.randbelow(hi - lo)


# -- building ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OwnerRef:
    """The Lease that owns a sandbox's objects: when it goes, the garbage collector takes
    them."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "name": self.name,
            "uid": self.uid,
        }


@dataclass(frozen=True, slots=True)
class PodPolicy:
    """What the validator holds a pod to, derived from the sandbox's config."""

    network: bool = False
    runtime_class_name: str | None = None
    host_users: bool = True
    cpu_limited: bool = True
    app_armor: bool = False

    @classmethod
    def of(cls, config: SandboxLifecycleConfig) -> PodPolicy:
        k = config.kubernetes
        return cls(
            network=config.network,
            runtime_class_name=k.runtime_class_name,
            host_users=k.host_users,
            cpu_limited=config.quotas.cpu_cores is not None,
            app_armor=k.app_armor,
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    pod: dict[str, Any]
    network_policy: dict[str, Any]
    shape: str  # what makes two pods interchangeable in a warm pool
    uid: int

    def objects(self) -> list[dict[str, Any]]:
        return [self.network_policy, self.pod]


def image_of(config: SandboxLifecycleConfig) -> str:
    return config.image or config.kubernetes.image


def _cpu(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def build_manifest(
    config: SandboxLifecycleConfig,
    *,
    sandbox_id: str,
    namespace: str,
    uid: int,
    server: ServerVersion | None = None,
    owner: OwnerRef | None = None,
    state: str = STATE_ACTIVE,
) -> Manifest:
    """The Pod and NetworkPolicy of a sandbox (see the module docstring)."""
    q, k = config.quotas, config.kubernetes
    key = sandbox_key(sandbox_id)
    name = NAME_PREFIX + key
    labels = {LABEL_MANAGED: MANAGED_BY, LABEL_SANDBOX: key, LABEL_STATE: state}
    if owner is not None:
        labels[LABEL_OWNER] = owner.name
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "annotations": {ANN_SANDBOX_ID: sandbox_id},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner.reference()]
    resources: dict[str, dict[str, str]] = {
        "limits": {"memory": str(q.memory_bytes)},
        "requests": {"memory": str(q.memory_bytes)},
    }
    if q.cpu_cores is not None:
        resources["limits"]["cpu"] = resources["requests"]["cpu"] = _cpu(q.cpu_cores)
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": WORKSPACE,
        "TMPDIR": TMP,
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        **config.env,
        "DEVS_SANDBOX_ID": sandbox_id,
    }
    pod_security: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if k.app_armor:
        if has_field("spec.securityContext.appArmorProfile", server):
            pod_security["appArmorProfile"] = {"type": "RuntimeDefault"}
        else:
            meta["annotations"][ANN_APPARMOR] = "runtime/default"
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "shareProcessNamespace": False,
        "hostname": "sandbox",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "activeDeadlineSeconds": -(-config.timeout_ms // 1000) + k.deadline_margin_s,
        "securityContext": pod_security,
        "containers": [
            {
                "name": CONTAINER,
                "image": image_of(config),
                "imagePullPolicy": k.image_pull_policy,
                "command": ["/bin/sh", "-c", INIT, INIT_NAME],
                "workingDir": WORKSPACE,
                "env": [{"name": n, "value": v} for n, v in env.items()],
                "resources": resources,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "workspace", "mountPath": WORKSPACE},
                    {"name": "tmp", "mountPath": TMP},
                    {"name": "shm", "mountPath": SHM},
                ],
            }
        ],
        "volumes": [
            {"name": "workspace", "emptyDir": {"medium": "Memory", "sizeLimit": str(q.disk_bytes)}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": str(k.tmp_bytes)}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(k.tmp_bytes)}},
        ],
    }
    if not k.host_users:
        spec["hostUsers"] = False
    if k.runtime_class_name:
        spec["runtimeClassName"] = k.runtime_class_name
    if k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    types = ["Ingress"] if config.network else ["Ingress", "Egress"]
    policy_meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {LABEL_MANAGED: MANAGED_BY, LABEL_SANDBOX: key},
        "annotations": {ANN_SANDBOX_ID: sandbox_id},
    }
    if owner is not None:
        policy_meta["labels"][LABEL_OWNER] = owner.name
        policy_meta["ownerReferences"] = [owner.reference()]
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": policy_meta,
        # No rules: nothing in (never needed) and, without network, nothing out.
        "spec": {
            "podSelector": {"matchLabels": {LABEL_MANAGED: MANAGED_BY, LABEL_SANDBOX: key}},
            "policyTypes": types,
        },
    }
    return Manifest(pod, policy, _shape(pod, types), uid)


def _shape(pod: dict[str, Any], policy_types: list[str]) -> str:
    """Hash of everything that tells two sandboxes apart, less what belongs to one pod
    (names, uid, id, deadline): pods of one shape are interchangeable in a warm pool."""
    spec = json.loads(json.dumps(pod["spec"]))
    spec.pop("activeDeadlineSeconds", None)
    for key in ("runAsUser", "runAsGroup"):
        spec["securityContext"].pop(key, None)
    c = spec["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "DEVS_SANDBOX_ID"]
    blob = json.dumps([spec, policy_types, pod["metadata"]["annotations"].get(ANN_APPARMOR)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# -- validation --------------------------------------------------------------------------
class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, why: str) -> None:
        self.items.append((path, why))

    def raise_if_any(self, what: str) -> None:
        if self.items:
            raise SecurityConfigError(
                f"insecure {what}: " + "; ".join(f"{p} {why}" for p, why in self.items),
                key=self.items[0][0],
            )


def _effective(pod_sc: Mapping[str, Any], c_sc: Mapping[str, Any], key: str) -> Any:
    return c_sc[key] if c_sc.get(key) is not None else pod_sc.get(key)


def _quantity_or_none(value: Any) -> Decimal | None:
    try:
        return parse_quantity(value)
    except ValueError:
        return None


def validate_pod_spec(pod: Mapping[str, Any], policy: PodPolicy | None = None) -> None:
    """Raise ``SecurityConfigError`` naming every field of ``pod`` that weakens a sandbox.

    Holds for the object we send and for the one the server stored (with its defaults).
    """
    policy = policy or PodPolicy()
    bad = _Problems()
    if pod.get("apiVersion") != "v1" or pod.get("kind") != "Pod":
        bad.add("kind", "must be a v1 Pod")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        bad.add("spec", "is missing")
        bad.raise_if_any("pod")
        return
    if (meta.get("labels") or {}).get(LABEL_MANAGED) != MANAGED_BY:
        bad.add(f"metadata.labels[{LABEL_MANAGED}]", f'must be "{MANAGED_BY}"')
    if spec.get("restartPolicy") != "Never":
        bad.add("spec.restartPolicy", 'must be "Never"')
    if spec.get("automountServiceAccountToken") is not False:
        bad.add("spec.automountServiceAccountToken", "must be false (no API token in a sandbox)")
    if spec.get("enableServiceLinks") is not False:
        bad.add("spec.enableServiceLinks", "must be false (no service addresses in the env)")
    for key in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        if spec.get(key):
            bad.add(f"spec.{key}", "must be false (no shared namespaces)")
    if "hostUsers" in spec and not isinstance(spec["hostUsers"], bool):
        bad.add("spec.hostUsers", "must be a boolean")
    elif not policy.host_users and spec.get("hostUsers") is not False:
        bad.add("spec.hostUsers", "must be false (kubernetes.hostUsers)")
    if policy.runtime_class_name and spec.get("runtimeClassName") != policy.runtime_class_name:
        bad.add("spec.runtimeClassName", f'must be "{policy.runtime_class_name}"')
    deadline = spec.get("activeDeadlineSeconds")
    if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline <= 0:
        bad.add("spec.activeDeadlineSeconds", "must be a positive number of seconds (backstop)")
    if spec.get("initContainers") or spec.get("ephemeralContainers"):
        bad.add("spec.initContainers", "must be empty: one container runs the sandbox")
    containers = spec.get("containers") or []
    if len(containers) != 1:
        bad.add("spec.containers", "must hold exactly one container")
        bad.raise_if_any("pod")
        return
    c = containers[0]
    pod_sc = spec.get("securityContext") or {}
    c_sc = c.get("securityContext") or {}
    for key, where in ((k, "spec.securityContext") for k in ("sysctls",)):
        if pod_sc.get(key):
            bad.add(f"{where}.{key}", "must be empty (no kernel settings for a sandbox)")
    if _effective(pod_sc, c_sc, "runAsNonRoot") is not True:
        bad.add("spec.securityContext.runAsNonRoot", "must be true")
    uid = _effective(pod_sc, c_sc, "runAsUser")
    if not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0:
        bad.add("spec.securityContext.runAsUser", "must be a uid of the sandbox's own (> 0)")
    gid = _effective(pod_sc, c_sc, "runAsGroup")
    if gid is not None and (not isinstance(gid, int) or isinstance(gid, bool) or gid <= 0):
        bad.add("spec.securityContext.runAsGroup", "must not be root's group")
    seccomp = (_effective(pod_sc, c_sc, "seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        bad.add("spec.securityContext.seccompProfile", 'must be "RuntimeDefault" (or Localhost)')
    for where, sc in (("spec.securityContext", pod_sc), ("containers[0].securityContext", c_sc)):
        armor = (sc.get("appArmorProfile") or {}).get("type")
        if armor == "Unconfined":
            bad.add(f"{where}.appArmorProfile", "must not be Unconfined")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.add(f"{where}.windowsOptions", "hostProcess is not allowed")
    annotations = meta.get("annotations") or {}
    for key, value in annotations.items():
        if str(key).startswith("container.apparmor.security.beta.kubernetes.io/") and (
            value == "unconfined"
        ):
            bad.add(f"metadata.annotations[{key}]", "must not be unconfined")
    if policy.app_armor and not (
        (pod_sc.get("appArmorProfile") or {}).get("type") == "RuntimeDefault"
        or annotations.get(ANN_APPARMOR) == "runtime/default"
    ):
        bad.add("spec.securityContext.appArmorProfile", "must be RuntimeDefault (appArmor)")
    where = "spec.containers[0]"
    if c_sc.get("allowPrivilegeEscalation") is not False:
        bad.add(f"{where}.securityContext.allowPrivilegeEscalation", "must be false")
    if c_sc.get("privileged"):
        bad.add(f"{where}.securityContext.privileged", "must be false")
    if c_sc.get("readOnlyRootFilesystem") is not True:
        bad.add(f"{where}.securityContext.readOnlyRootFilesystem", "must be true")
    caps = c_sc.get("capabilities") or {}
    if [str(x).upper() for x in caps.get("drop") or []] != ["ALL"]:
        bad.add(f"{where}.securityContext.capabilities.drop", 'must be ["ALL"]')
    if caps.get("add"):
        bad.add(f"{where}.securityContext.capabilities.add", "must be empty")
    if c_sc.get("procMount") not in (None, "Default"):
        bad.add(f"{where}.securityContext.procMount", 'must be "Default" (masked /proc)')
    if c.get("command") != ["/bin/sh", "-c", INIT, INIT_NAME]:
        bad.add(f"{where}.command", "must be the sandbox's init (it reaps orphans)")
    for port in c.get("ports") or []:
        if port.get("hostPort"):
            bad.add(f"{where}.ports", "hostPort is not allowed")
    if c.get("envFrom"):
        bad.add(f"{where}.envFrom", "must be empty (secrets reach a sandbox as files only)")
    for item in c.get("env") or []:
        if item.get("valueFrom"):
            bad.add(f"{where}.env[{item.get('name')}]", "valueFrom is not allowed (secrets)")
    res = c.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    mem = _quantity_or_none(limits.get("memory"))
    if mem is None or mem <= 0:
        bad.add(f"{where}.resources.limits.memory", "must be set")
    elif _quantity_or_none(requests.get("memory")) != mem:
        bad.add(f"{where}.resources.requests.memory", "must equal the memory limit")
    cpu = _quantity_or_none(limits.get("cpu")) if "cpu" in limits else None
    if cpu is None and (policy.cpu_limited or "cpu" in limits):
        bad.add(f"{where}.resources.limits.cpu", "must be set")
    elif cpu is not None and _quantity_or_none(requests.get("cpu")) != cpu:
        bad.add(f"{where}.resources.requests.cpu", "must equal the cpu limit")
    elif cpu is None and "cpu" in requests:
        bad.add(f"{where}.resources.requests.cpu", "must equal the cpu limit (none)")
    _validate_volumes(spec, c, bad)
    bad.raise_if_any("pod spec")


def _validate_volumes(spec: Mapping[str, Any], c: Mapping[str, Any], bad: _Problems) -> None:
    volumes: dict[str, Mapping[str, Any]] = {}
    for vol in spec.get("volumes") or []:
        name = str(vol.get("name"))
        kinds = set(vol) - {"name"}
        if kinds != {"emptyDir"}:
            bad.add(f"spec.volumes[{name}]", "must be an emptyDir (no host paths, no claims)")
            continue
        empty = vol.get("emptyDir") or {}
        if empty.get("medium") != "Memory":
            bad.add(f"spec.volumes[{name}].emptyDir.medium", 'must be "Memory"')
        size = _quantity_or_none(empty.get("sizeLimit"))
        if size is None or size <= 0:
            bad.add(f"spec.volumes[{name}].emptyDir.sizeLimit", "must be set")
        volumes[name] = vol
    mounted: dict[str, str] = {}
    for vm in c.get("volumeMounts") or []:
        path = str(vm.get("mountPath"))
        if vm.get("subPath") or vm.get("subPathExpr"):
            bad.add(f"spec.containers[0].volumeMounts[{path}]", "subPath is not allowed")
        if vm.get("mountPropagation") not in (None, "None"):
            bad.add(f"spec.containers[0].volumeMounts[{path}]", "mountPropagation must be None")
        if vm.get("name") not in volumes:
            bad.add(f"spec.containers[0].volumeMounts[{path}]", "must mount a declared emptyDir")
        mounted[path] = str(vm.get("name"))
    for path in (WORKSPACE, TMP):
        if path not in mounted:
            bad.add(f"spec.containers[0].volumeMounts[{path}]", "must be a Memory emptyDir")


def validate_network_policy(
    policy: Mapping[str, Any], pod: Mapping[str, Any], *, network: bool = False
) -> None:
    """Raise ``SecurityConfigError`` unless ``policy`` selects ``pod`` and lets nothing in,
    and (without ``network``) nothing out."""
    bad = _Problems()
    if policy.get("kind") != "NetworkPolicy" or policy.get("apiVersion") != (
        "networking.k8s.io/v1"
    ):
        bad.add("kind", "must be a networking.k8s.io/v1 NetworkPolicy")
    spec = policy.get("spec") or {}
    selector = spec.get("podSelector") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    match = selector.get("matchLabels") or {}
    if (
        not match
        or selector.get("matchExpressions")
        or any(labels.get(k) != v for k, v in match.items())
    ):
        bad.add("spec.podSelector", "must select the sandbox's pod by its labels")
    types = spec.get("policyTypes") or []
    if "Ingress" not in types or spec.get("ingress"):
        bad.add("spec.ingress", "must deny all ingress (Ingress type, no rules)")
    if not network and ("Egress" not in types or spec.get("egress")):
        bad.add("spec.egress", "must deny all egress without network (Egress type, no rules)")
    bad.raise_if_any("network policy")

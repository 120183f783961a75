"""The Kubernetes driver's objects: built hardened, refused when weakened, valid on 1.28-1.37.

Pure: no cluster, no Docker. ``kubernetes-validate --strict`` holds every object we emit
against each supported server's schema (a field newer than a server is emitted only for a
server that has it); the validator is shown to refuse each hardening field on its own.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.drivers.kubernetes import manifest as mf
from devs_sandbox.drivers.kubernetes.leases import lease_body, lease_expired, micro_time
from devs_sandbox.drivers.kubernetes.pool import warm_manifest
from devs_sandbox.errors import ConfigError, SecurityConfigError

pytestmark = pytest.mark.kubernetes

VERSIONS = [f"1.{minor}" for minor in range(28, 38)]
MANIFEST = [sys.executable, "-m", "devs_sandbox", "kubernetes", "manifest"]


def config(**changes: Any) -> SandboxLifecycleConfig:
    return override(SandboxLifecycleConfig(), driver="kubernetes", **changes)


def build(cfg: SandboxLifecycleConfig | None = None, **kw: Any) -> mf.Manifest:
    kw.setdefault("sandbox_id", "sb-0123456789ab")
    kw.setdefault("namespace", "sandboxes")
    kw.setdefault("uid", 1_800_000_123)
    return mf.build_manifest(cfg or config(), **kw)


# -- the hardening, field by field ----------------------------------------------------------
def test_the_pod_carries_every_hardening_field() -> None:
    cfg = config(quotas={"memory_bytes": 256 << 20, "cpu_cores": 0.5, "disk_bytes": 64 << 20})
    pod = build(cfg).pod
    spec = pod["spec"]
    c = spec["containers"][0]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        assert spec[key] is False
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1_800_000_123,
        "runAsGroup": 1_800_000_123,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert (
        c["resources"]["limits"]
        == c["resources"]["requests"]
        == {
            "memory": str(256 << 20),
            "cpu": "500m",
        }
    )
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["workspace"] == {
        "name": "workspace",
        "emptyDir": {"medium": "Memory", "sizeLimit": str(64 << 20)},
    }
    assert volumes["tmp"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/workspace": "workspace", "/tmp": "tmp", "/dev/shm": "shm"}
    # Our own timeout (300 s by default) fires first; the kubelet's is the backstop.
    assert spec["activeDeadlineSeconds"] == 300 + cfg.kubernetes.deadline_margin_s
    assert "hostUsers" not in spec and "runtimeClassName" not in spec
    env = {e["name"] for e in c["env"]}
    assert not any("valueFrom" in e for e in c["env"]) and "envFrom" not in c
    assert env >= {"PATH", "HOME", "TMPDIR", "DEVS_SANDBOX_ID"}
    mf.validate_pod_spec(pod, mf.PodPolicy.of(cfg))


def test_runtime_class_and_user_namespaces_are_emitted_and_then_required() -> None:
    cfg = config(kubernetes={"runtime_class_name": "gvisor", "host_users": False})
    pod = build(cfg, uid=mf.pick_uid(cfg)).pod
    assert pod["spec"]["runtimeClassName"] == "gvisor"
    assert pod["spec"]["hostUsers"] is False
    assert 0 < pod["spec"]["securityContext"]["runAsUser"] < 65_536  # the pod's own range
    policy = mf.PodPolicy.of(cfg)
    mf.validate_pod_spec(pod, policy)
    for key in ("runtimeClassName", "hostUsers"):
        weak = copy.deepcopy(pod)
        del weak["spec"][key]
        with pytest.raises(SecurityConfigError, match=f"spec.{key}"):
            mf.validate_pod_spec(weak, policy)


def test_uids_are_the_sandboxes_own() -> None:
    uids = {mf.pick_uid(config()) for _ in range(50)}
    assert len(uids) == 50 and min(uids) >= mf.UID_RANGE[0] and max(uids) < mf.UID_RANGE[1]
    assert mf.pick_uid(config(isolation={"run_as_user": 4242})) == 4242
    with pytest.raises(ConfigError, match="runAsUser"):
        mf.pick_uid(config(isolation={"run_as_user": "current"}))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        holder: Any = pod
        for part in parents:
            holder = holder[int(part)] if part.isdigit() else holder.setdefault(part, {})
        if value is _DELETE:
            holder.pop(last, None)
        else:
            holder[last] = value

    return change


_DELETE = object()
C = "spec.containers.0"
DEVIATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("restartPolicy", _set("spec.restartPolicy", "Always"), "spec.restartPolicy"),
    ("token", _set("spec.automountServiceAccountToken", True), "automountServiceAccountToken"),
    ("token unset", _set("spec.automountServiceAccountToken", _DELETE), "automountService"),
    ("service links", _set("spec.enableServiceLinks", True), "spec.enableServiceLinks"),
    ("hostNetwork", _set("spec.hostNetwork", True), "spec.hostNetwork"),
    ("hostPID", _set("spec.hostPID", True), "spec.hostPID"),
    ("hostIPC", _set("spec.hostIPC", True), "spec.hostIPC"),
    ("shared pids", _set("spec.shareProcessNamespace", True), "spec.shareProcessNamespace"),
    ("no deadline", _set("spec.activeDeadlineSeconds", _DELETE), "activeDeadlineSeconds"),
    ("root", _set("spec.securityContext.runAsUser", 0), "runAsUser"),
    ("root by container", _set(f"{C}.securityContext.runAsUser", 0), "runAsUser"),
    ("no uid", _set("spec.securityContext.runAsUser", _DELETE), "runAsUser"),
    ("non-root off", _set("spec.securityContext.runAsNonRoot", False), "runAsNonRoot"),
    ("root group", _set("spec.securityContext.runAsGroup", 0), "runAsGroup"),
    ("unconfined", _set("spec.securityContext.seccompProfile", {"type": "Unconfined"}), "seccomp"),
    ("no seccomp", _set("spec.securityContext.seccompProfile", _DELETE), "seccompProfile"),
    (
        "seccomp overridden",
        _set(f"{C}.securityContext.seccompProfile", {"type": "Unconfined"}),
        "seccompProfile",
    ),
    ("sysctls", _set("spec.securityContext.sysctls", [{"name": "a", "value": "1"}]), "sysctls"),
    (
        "apparmor off",
        _set("spec.securityContext.appArmorProfile", {"type": "Unconfined"}),
        "appArmorProfile",
    ),
    ("escalation", _set(f"{C}.securityContext.allowPrivilegeEscalation", True), "allowPrivilege"),
    ("escalation unset", _set(f"{C}.securityContext.allowPrivilegeEscalation", _DELETE), "Privi"),
    ("privileged", _set(f"{C}.securityContext.privileged", True), "privileged"),
    ("writable root", _set(f"{C}.securityContext.readOnlyRootFilesystem", False), "readOnlyRoot"),
    ("caps kept", _set(f"{C}.securityContext.capabilities", {"drop": ["NET_RAW"]}), "drop"),
    (
        "caps added",
        _set(f"{C}.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        "capabilities.add",
    ),
    ("unmasked proc", _set(f"{C}.securityContext.procMount", "Unmasked"), "procMount"),
    ("no memory limit", _set(f"{C}.resources.limits.memory", _DELETE), "limits.memory"),
    ("burstable memory", _set(f"{C}.resources.requests.memory", "1"), "requests.memory"),
    ("no cpu limit", _set(f"{C}.resources.limits.cpu", _DELETE), "limits.cpu"),
    ("burstable cpu", _set(f"{C}.resources.requests.cpu", "1m"), "requests.cpu"),
    ("host port", _set(f"{C}.ports", [{"containerPort": 80, "hostPort": 80}]), "hostPort"),
    ("secret env", _set(f"{C}.env", [{"name": "X", "valueFrom": {"secretKeyRef": {}}}]), "env"),
    ("env from", _set(f"{C}.envFrom", [{"secretRef": {"name": "s"}}]), "envFrom"),
    ("other command", _set(f"{C}.command", ["sleep", "infinity"]), "command"),
    ("two containers", lambda p: p["spec"]["containers"].append({"name": "x"}), "containers"),
    ("init container", _set("spec.initContainers", [{"name": "i"}]), "initContainers"),
    (
        "host path",
        lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "spec.volumes[h]",
    ),
    (
        "disk-backed workspace",
        lambda p: p["spec"]["volumes"][0]["emptyDir"].pop("medium"),
        "emptyDir.medium",
    ),
    (
        "unbounded workspace",
        lambda p: p["spec"]["volumes"][0]["emptyDir"].pop("sizeLimit"),
        "emptyDir.sizeLimit",
    ),
    (
        "subPath",
        lambda p: p["spec"]["containers"][0]["volumeMounts"][0].update(subPath="x"),
        "subPath",
    ),
    (
        "no workspace",
        lambda p: p["spec"]["containers"][0]["volumeMounts"].pop(0),
        "volumeMounts[/workspace]",
    ),
    ("not ours", _set("metadata.labels", {}), "managed-by"),
]


@pytest.mark.parametrize(
    ("change", "field"), [d[1:] for d in DEVIATIONS], ids=[d[0] for d in DEVIATIONS]
)
def test_the_validator_refuses_each_deviation(
    change: Callable[[dict[str, Any]], None], field: str
) -> None:
    pod = copy.deepcopy(build().pod)
    mf.validate_pod_spec(pod)  # the control: the built pod passes
    change(pod)
    with pytest.raises(SecurityConfigError, match=re.escape(field)):
        mf.validate_pod_spec(pod)


def test_the_validator_accepts_what_a_server_adds() -> None:
    """Defaults and canonical quantities of a stored pod are not deviations."""
    pod = copy.deepcopy(build().pod)
    c = pod["spec"]["containers"][0]
    c["resources"] = {
        "limits": {"memory": "2Gi", "cpu": "1"},
        "requests": {"memory": "2Gi", "cpu": "1"},
    }
    pod["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "1Gi"
    pod["spec"].update(dnsPolicy="ClusterFirst", schedulerName="default-scheduler", priority=0)
    c.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    c["securityContext"]["procMount"] = "Default"
    mf.validate_pod_spec(pod)


def test_the_network_policy_denies_everything_unless_network_is_asked_for() -> None:
    closed = build()
    assert closed.network_policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in closed.network_policy["spec"]
    assert "egress" not in closed.network_policy["spec"]
    mf.validate_network_policy(closed.network_policy, closed.pod)
    opened = build(config(network=True))
    assert opened.network_policy["spec"]["policyTypes"] == ["Ingress"]
    mf.validate_network_policy(opened.network_policy, opened.pod, network=True)
    with pytest.raises(SecurityConfigError, match=r"spec\.egress"):
        mf.validate_network_policy(opened.network_policy, opened.pod)
    leaky = copy.deepcopy(closed.network_policy)
    leaky["spec"]["egress"] = [{}]
    with pytest.raises(SecurityConfigError, match=r"spec\.egress"):
        mf.validate_network_policy(leaky, closed.pod)
    other = copy.deepcopy(closed.network_policy)
    other["spec"]["podSelector"] = {"matchLabels": {mf.LABEL_SANDBOX: "someone-else"}}
    with pytest.raises(SecurityConfigError, match="podSelector"):
        mf.validate_network_policy(other, closed.pod)
    everything = copy.deepcopy(closed.network_policy)
    everything["spec"]["podSelector"] = {}
    with pytest.raises(SecurityConfigError, match="podSelector"):
        mf.validate_network_policy(everything, closed.pod)


# -- schemas --------------------------------------------------------------------------------
def _objects(server: tuple[int, int]) -> list[tuple[str, dict[str, Any]]]:
    owner = mf.OwnerRef("devs-sandbox-owner-0123456789ab", "0b1c2d3e-aaaa-bbbb-cccc-000000000000")
    variants = {
        "default": config(),
        "network": config(network=True),
        "hardened": config(
            kubernetes={"runtime_class_name": "gvisor", "host_users": False, "app_armor": True},
            quotas={"cpu_cores": None},
            env={"A": "1"},
        ),
    }
    out: list[tuple[str, dict[str, Any]]] = []
    for name, cfg in variants.items():
        made = build(cfg, server=server, owner=owner)
        out += [(f"{name}-pod", made.pod), (f"{name}-policy", made.network_policy)]
        out.append((f"{name}-warm-pod", warm_manifest(made).pod))
    out.append(("lease", lease_body(owner.name, "host/1", 30)))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly_against_each_supported_server(version: str) -> None:
    server = mf.parse_server_version(*version.split("."))
    for name, obj in _objects(server):
        try:
            kubernetes_validate.validate(obj, f"{version}.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is not a valid object for {version}: {exc}")


def test_a_newer_field_is_emitted_only_for_a_server_that_has_it() -> None:
    cfg = config(kubernetes={"app_armor": True})
    new = build(cfg, server=(1, 33)).pod
    old = build(cfg, server=(1, 29)).pod
    assert new["spec"]["securityContext"]["appArmorProfile"] == {"type": "RuntimeDefault"}
    assert "appArmorProfile" not in old["spec"]["securityContext"]
    assert old["metadata"]["annotations"][mf.ANN_APPARMOR] == "runtime/default"
    mf.validate_pod_spec(new, mf.PodPolicy.of(cfg))
    mf.validate_pod_spec(old, mf.PodPolicy.of(cfg))
    # The gate is needed: the field is not in 1.29's schema.
    with pytest.raises(kubernetes_validate.ValidationError, match="appArmorProfile"):
        kubernetes_validate.validate(new, "1.29.0", strict=True)
    # Unknown version: the oldest supported server's objects.
    assert "appArmorProfile" not in build(cfg, server=None).pod["spec"]["securityContext"]


def test_the_validator_of_kubernetes_validate_catches_a_typo() -> None:
    """The schema check is live: an unknown field fails it (the control for the above)."""
    pod = copy.deepcopy(build().pod)
    pod["spec"]["securityContext"]["runAsNonRooot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.33.0", strict=True)


# -- names, quantities, leases -------------------------------------------------------------
@pytest.mark.parametrize(
    "sandbox_id", ["sb-0123456789ab", "My_Box.1", "a" * 64, "-x-", "A", "a", "x.y"]
)
def test_every_sandbox_id_gets_a_valid_and_distinct_pod_name(sandbox_id: str) -> None:
    key = mf.sandbox_key(sandbox_id)
    assert len(key) <= 63 and key == key.lower() and key[0].isalnum() and key[-1].isalnum()
    pod = build(sandbox_id=sandbox_id).pod
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    assert pod["metadata"]["annotations"][mf.ANN_SANDBOX_ID] == sandbox_id
    if sandbox_id != sandbox_id.lower():
        assert mf.sandbox_key(sandbox_id) != mf.sandbox_key(sandbox_id.lower())


def test_quantities_parse_as_the_api_server_writes_them() -> None:
    assert mf.parse_quantity("64Mi") == 64 << 20
    assert mf.parse_quantity("500m") * 1000 == 500
    assert mf.parse_quantity("1e3") == 1000
    assert mf.parse_quantity(67108864) == 64 << 20
    for bad in ("2 GiB", "lots", True, ""):
        with pytest.raises(ValueError, match="quantity"):
            mf.parse_quantity(bad)


def test_a_lease_expires_after_twice_its_duration_without_renewal() -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    lease = lease_body("l", "h/1", 10)
    assert not lease_expired(lease, now)
    lease["spec"]["renewTime"] = micro_time(now - timedelta(seconds=15))
    assert not lease_expired(lease, now)  # within the skew allowance
    lease["spec"]["renewTime"] = micro_time(now - timedelta(seconds=21))
    assert lease_expired(lease, now)


def test_the_manifest_command_prints_valid_objects_without_a_cluster(tmp_path: Any) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}  # no cluster to reach
    out = subprocess.run(
        [
            *MANIFEST,
            *("--memory", "256m", "--network", "--output", "json", "--server-version", "1.33"),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    items = json.loads(out)["items"]
    assert [i["kind"] for i in items] == ["NetworkPolicy", "Pod"]
    pod = items[1]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == str(256 << 20)
    assert items[0]["spec"]["policyTypes"] == ["Ingress"]
    for obj in items:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    yaml_out = subprocess.run(
        [*MANIFEST, "--max-processes", "9"], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "kind: Pod" in yaml_out and "readOnlyRootFilesystem: true" in yaml_out

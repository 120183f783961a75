"""The Kubernetes driver against a cluster: the emulated stack (API server + test kubelet on
Docker, through the official client and a kubeconfig) and, behind ``kubernetes_cluster``,
a real one.

Contract tests use the emulator's fault hooks (quota, 410, a dropped exec status, a
conflicting patch) and act as the kubelet where a test needs a pod status no container can
produce here. The rest are end to end: real containers, a real OOM, a real ENOSPC, SIGXFSZ,
a fork cap, an exec timeout and force_stop, each asserting what the sandbox promised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox import (
    CapacityError,
    DiskQuotaExceededError,
    ExecLostError,
    QuotaExceededError,
    SandboxLifecycleManager,
)
from devs_sandbox.base import ExecRequest
from devs_sandbox.drivers.kubernetes.manifest import (
    LABEL_OWNER,
    LABEL_STATE,
    PodPolicy,
    validate_network_policy,
    validate_pod_spec,
)
from devs_sandbox.errors import WeakerIsolationError
from devs_sandbox.events import SandboxEvents
from devs_sandbox.models import ViolationType
from devs_sandbox.store import ViolationStore
from kubernetes import client as kclient
from tests.kubernetes.driver.helpers import BOTH, Target, wait_for, wait_for_empty
from tests.kubernetes.emulator import Quota

pytestmark = pytest.mark.kubernetes

HOG = "b = []\nwhile True: b.append(bytearray(1 << 20))"
PS = (
    "import os\n"
    "for p in sorted(os.listdir('/proc'), key=lambda x: x.zfill(9)):\n"
    "    if p.isdigit():\n"
    "        try:\n"
    "            print(p, open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ')"
    ".decode().strip())\n"
    "        except OSError:\n"
    "            pass\n"
)


def manager(target: Target, tmp_path: Path, **settings: Any) -> tuple[SandboxLifecycleManager, Any]:
    driver = target.driver(**settings)
    store = ViolationStore(tmp_path / "violations.db")
    return SandboxLifecycleManager(driver, store=store, reap_orphans=False), driver


def as_dict(api_obj: Any, core: Any) -> dict[str, Any]:
    out: dict[str, Any] = core.api_client.sanitize_for_serialization(api_obj)
    return out


def requests(target: Target) -> list[Any]:
    """Every request the emulated API server answered (kmock's log)."""
    return list(target.emulator._requests)


def processes(driver: Any, ctx: Any) -> list[str]:
    return driver.exec(ctx, ExecRequest(("python3", "-c", PS))).stdout.text.splitlines()


# -- provision and destroy ------------------------------------------------------------------
@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_a_sandbox_is_a_hardened_pod_owned_by_a_lease_and_destroy_twice_is_harmless(
    target: Target,
) -> None:
    driver = target.driver()
    cfg = target.config(quotas={"memory_bytes": 128 << 20})
    ctx = driver.provision(cfg)
    core = target.core()
    pod = as_dict(core.read_namespaced_pod(ctx.labels["pod"], target.namespace), core)
    validate_pod_spec(pod, PodPolicy.of(cfg))  # as the server stored it
    net = kclient.NetworkingV1Api(core.api_client)
    policy = as_dict(net.read_namespaced_network_policy(ctx.labels["pod"], target.namespace), core)
    validate_network_policy(policy, pod)
    owners = pod["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("Lease", driver.lease.name)]
    assert [(o["kind"], o["uid"]) for o in policy["metadata"]["ownerReferences"]] == [
        ("Pod", pod["metadata"]["uid"])
    ]
    for mechanism in ("rlimits", "network-policy", "seccomp", "read-only-rootfs", "exec-subreaper"):
        assert mechanism in ctx.isolation
    assert any(m.startswith("cgroup") for m in ctx.isolation)
    out = driver.exec(ctx, ExecRequest.of("id -u; touch /x 2>&1; ls /sys/class/net"))
    uid, touch, *ifaces = out.stdout.text.splitlines()
    assert uid == ctx.labels["uid"] and int(uid) > 0
    assert "Read-only file system" in touch
    if target.emulated:
        assert ifaces == ["lo"]  # the deny-all policy took the network away
    driver.destroy(ctx)
    driver.destroy(ctx)
    wait_for(
        lambda: not target.objects() or target.objects() == [f"lease/{driver.lease.name}"],
        "the pod to go",
    )


@pytest.mark.docker
def test_a_quota_refusal_is_a_capacity_error_at_once_and_leaves_nothing(emulated: Target) -> None:
    emulated.emulator.quotas.append(Quota({"pods": "0"}, name="sandboxes"))
    driver = emulated.driver()
    with pytest.raises(CapacityError, match="exceeded quota: sandboxes") as info:
        driver.provision(emulated.config(kubernetes={"start_timeout_s": 3600}))
    assert "limited: pods=0" in info.value.reason
    creates = [r for r in requests(emulated) if r.method == "POST" and r.url.path.endswith("/pods")]
    assert len(creates) == 1  # reported at once: no retry, no wait for a pod that never comes
    assert emulated.objects() == [f"lease/{driver.lease.name}"]  # its NetworkPolicy undone


# -- the pod watch ------------------------------------------------------------------------------
def _oom_status(core: Any, name: str, ns: str) -> None:
    """What a kubelet reports when the container was OOM-killed (cgroup v2: the whole
    container); written by the test because no container here dies that way."""
    core.patch_namespaced_pod_status(
        name,
        ns,
        {
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "sandbox",
                        "image": "x",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                    }
                ],
            }
        },
    )


@pytest.mark.docker
@pytest.mark.parametrize("expire_watch", [False, True], ids=["watch", "after-410"])
def test_an_oom_in_the_pod_status_is_memory_exceeded_recorded_before_the_pod_goes(
    emulated: Target, tmp_path: Path, expire_watch: bool
) -> None:
    mgr, driver = manager(emulated, tmp_path)
    core = emulated.core()
    seen_pod_at_record: list[bool] = []

    def on_violation(_name: str, event: dict[str, Any]) -> None:
        pods = core.list_namespaced_pod(emulated.namespace, field_selector=f"metadata.name={pod}")
        seen_pod_at_record.append(bool(pods.items))

    mgr.bus.on(SandboxEvents.VIOLATION, on_violation)
    ooms: list[dict[str, Any]] = []
    driver._emit = lambda name, payload: ooms.append(payload) if name == SandboxEvents.OOM else None
    sandbox = mgr.open_sandbox(emulated.config())
    pod = sandbox.context.labels["pod"]
    watcher = driver.watcher
    assert watcher is not None
    wait_for(watcher.synced.is_set, "the watch")
    if expire_watch:
        lists = watcher.lists
        assert emulated.emulator.expire_watches() >= 1  # ERROR 410 on the open watch
        wait_for(lambda: watcher.lists > lists, "the watcher to list again after 410")
    _oom_status(core, pod, emulated.namespace)
    wait_for(lambda: not driver.is_running(sandbox.context), "the watch to see the pod end")
    assert ooms and ooms[0]["reason"] == "OOMKilled" and ooms[0]["sandbox_id"] == sandbox.id
    verdict = mgr.detector.poll_once(sandbox.id)
    assert verdict is not None and verdict.violation == ViolationType.MEMORY_EXCEEDED
    rows = mgr.store.list(sandbox_id=sandbox.id)
    assert [r["violation_type"] for r in rows] == ["MEMORY_EXCEEDED"]
    assert seen_pod_at_record == [True]
    sandbox.destroy()
    mgr.shutdown()


# -- crash cleanup ---------------------------------------------------------------------------
OWNER_SCRIPT = """
import sys, time
from devs_sandbox.config import KubernetesConfig, SandboxLifecycleConfig, override
from devs_sandbox.drivers.kubernetes.driver import KubernetesDriver
k = dict(kubeconfig=sys.argv[1], namespace=sys.argv[2], lease_duration_s=2)
d = KubernetesDriver(kubernetes=KubernetesConfig(**k))
ctx = d.provision(override(SandboxLifecycleConfig(), driver="kubernetes", kubernetes=k))
print(ctx.id, ctx.labels["pod"], d.lease.name, flush=True)
time.sleep(600)
"""


@pytest.mark.docker
def test_a_dead_owners_sandboxes_are_reaped_through_its_lease(emulated: Target) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(emulated.kubeconfig), emulated.namespace],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        sandbox_id, pod, lease = owner.stdout.readline().split()
    finally:
        owner.send_signal(signal.SIGKILL)  # no close(), no destroy: a crash
        owner.wait(30)
    core = emulated.core()
    assert (
        core.read_namespaced_pod(pod, emulated.namespace).metadata.owner_references[0].name == lease
    )
    bystander = emulated.driver()  # a live owner's sandbox must survive the reaping
    kept = bystander.provision(emulated.config())
    env = {**os.environ, "KUBECONFIG": str(emulated.kubeconfig)}

    def cleanup() -> Any:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "devs_sandbox",
                "cleanup",
                "--driver",
                "kubernetes",
                "--json",
                "--namespace",
                emulated.namespace,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["reaped"].get("kubernetes")

    reaped = wait_for(cleanup, "the lease to expire (2 x 2 s) and cleanup to reap it")
    assert reaped == [sandbox_id]
    wait_for(
        lambda: (
            not core.list_namespaced_pod(
                emulated.namespace, field_selector=f"metadata.name={pod}"
            ).items
        ),
        "the pod to go",
    )
    assert all(lease not in o for o in emulated.objects())
    assert core.read_namespaced_pod(kept.labels["pod"], emulated.namespace)  # untouched
    bystander.destroy(kept)


# -- warm pool --------------------------------------------------------------------------------
@pytest.mark.docker
def test_warm_pool_claims_race_and_every_pod_gets_exactly_one_owner(emulated: Target) -> None:
    a, b = emulated.driver(), emulated.driver()
    cfg = emulated.config(kubernetes={"warm_pool_size": 2})
    first = a.provision(cfg)  # cold: asks the pool for 2 more
    core = emulated.core()

    def warm() -> list[Any]:
        selector = f"{LABEL_STATE}=warm"
        return list(core.list_namespaced_pod(emulated.namespace, label_selector=selector).items)

    wait_for(lambda: len(warm()) == 2, "two warm pods")
    emulated.emulator.fail_next("patch", "pods", 409)  # the first claim attempt loses a race
    results: list[Any] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def claim(driver: Any) -> None:
        barrier.wait()
        try:
            results.append((driver, driver.provision(cfg)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(d,)) for d in (a, a, b, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    pods = [ctx.labels["pod"] for _, ctx in results]
    assert len(set(pods)) == 4  # no pod went to two sandboxes
    assert a.pool.claims + b.pool.claims >= 1  # warm pods were used...
    assert a.pool.conflicts + b.pool.conflicts >= 1  # ...and a lost claim went elsewhere
    for driver, ctx in results:
        live = core.read_namespaced_pod(ctx.labels["pod"], emulated.namespace)
        assert live.metadata.labels[LABEL_OWNER] == driver.lease.name
        assert [o.name for o in live.metadata.owner_references] == [driver.lease.name]
        assert live.spec.active_deadline_seconds <= cfg.timeout_ms // 1000 + 60 + 30
        assert (
            driver.exec(ctx, ExecRequest.of("echo $DEVS_SANDBOX_ID")).stdout.text == f"{ctx.id}\n"
        )
        driver.destroy(ctx)
    a.destroy(first)


# -- exec ----------------------------------------------------------------------------------------
@pytest.mark.docker
def test_a_missing_exec_status_is_a_lost_exec_never_exit_0(emulated: Target) -> None:
    driver = emulated.driver()
    ctx = driver.provision(emulated.config())
    emulated.emulator.drop_next_exec_status()
    with pytest.raises(ExecLostError, match="lost the exec"):
        driver.exec(ctx, ExecRequest.of("echo ran"))
    assert driver.exec(ctx, ExecRequest.of("exit 4")).exit_code == 4  # the sandbox still works
    driver.destroy(ctx)


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_secrets_arrive_as_0400_files_and_nowhere_else(target: Target) -> None:
    secret = b'it\'s a "secret"\n$HOME `x`'
    driver = target.driver()
    ctx = driver.provision(target.config(), secrets={"API_TOKEN": secret})
    out = driver.exec(
        ctx,
        ExecRequest.of('f="$API_TOKEN_FILE"; stat -c "%a %u" "$f" "$(dirname "$f")"; cat "$f"'),
    )
    mode, dir_mode, *rest = out.stdout.text.splitlines()
    assert mode == f"400 {ctx.labels['uid']}" and dir_mode.startswith("500 ")
    assert "[REDACTED:API_TOKEN]" in "\n".join(rest) and "secret" not in out.stdout.text
    found = driver.exec(
        ctx,
        ExecRequest(
            (
                "python3",
                "-c",
                "import os,sys\nv=open(os.environ['API_TOKEN_FILE'],'rb').read()\n"
                "n=0\nfor p in os.listdir('/proc'):\n  for f in ('environ','cmdline'):\n"
                "    try: n += v in open(f'/proc/{p}/{f}','rb').read()\n    except OSError: pass\n"
                "print(n)",
            ),
        ),
    )
    assert found.stdout.text == "0\n"  # in no process's argv or environment
    core = target.core()
    stored = json.dumps(
        as_dict(core.read_namespaced_pod(ctx.labels["pod"], target.namespace), core)
    )
    assert "secret" not in stored
    if target.emulated:  # every request the API server saw: URLs and bodies
        for r in requests(target):
            assert secret not in (r.body or b"") and b"secret" not in str(r.url).encode()
    driver.destroy(ctx)


# -- limits, end to end -------------------------------------------------------------------------
@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_a_real_oom_is_memory_exceeded_recorded_before_deletion_and_137(
    target: Target, tmp_path: Path
) -> None:
    mgr, _ = manager(target, tmp_path)
    core = target.core()
    pods_at_record: list[int] = []
    mgr.bus.on(
        SandboxEvents.VIOLATION,
        lambda _n, e: pods_at_record.append(
            len(
                core.list_namespaced_pod(
                    target.namespace, label_selector=f"devs-sandbox.io/sandbox={e['sandbox_id']}"
                ).items
            )
        ),
    )
    cfg = target.config(quotas={"memory_bytes": 96 << 20})
    with pytest.raises(QuotaExceededError) as info:
        mgr.run_in_sandbox(["python3", "-c", HOG], cfg)
    v = info.value.violation
    assert v.type == ViolationType.MEMORY_EXCEEDED and v.limit_value == 96 << 20
    assert info.value.outcome is not None and info.value.outcome.exit_code == 137
    assert info.value.outcome.result.exit_code == 137  # the kernel's SIGKILL, seen as 137
    assert [r["violation_type"] for r in mgr.store.list(sandbox_id=v.sandbox_id)] == [
        "MEMORY_EXCEEDED"
    ]
    assert pods_at_record == [1]  # recorded while the pod still existed
    mgr.shutdown()


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_a_full_memory_emptydir_is_enospc_and_disk_quota_exceeded(
    target: Target, tmp_path: Path
) -> None:
    mgr, _ = manager(target, tmp_path)
    cfg = target.config(quotas={"disk_bytes": 8 << 20})
    with pytest.raises(DiskQuotaExceededError) as info:
        mgr.run_in_sandbox("dd if=/dev/zero of=/workspace/f bs=1M count=16", cfg)
    assert info.value.violation.type == ViolationType.DISK_QUOTA_EXCEEDED
    assert info.value.outcome is not None
    assert "No space left on device" in info.value.outcome.result.stderr.text
    assert info.value.outcome.exit_code == 137
    mgr.shutdown()


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_a_write_past_the_file_size_limit_is_sigxfsz(target: Target, tmp_path: Path) -> None:
    mgr, _ = manager(target, tmp_path)
    cfg = target.config(quotas={"max_file_size_bytes": 1 << 20})
    with pytest.raises(QuotaExceededError) as info:
        mgr.run_in_sandbox(["dd", "if=/dev/zero", "of=/workspace/f", "bs=1M", "count=4"], cfg)
    assert info.value.violation.type == ViolationType.FILE_SIZE_EXCEEDED
    assert info.value.outcome is not None
    assert info.value.outcome.result.signal == signal.SIGXFSZ
    mgr.shutdown()


FORKS = (
    "import os, signal, time\n"
    "kids = []\n"
    "try:\n"
    "    for _ in range(100):\n"
    "        pid = os.fork()\n"
    "        if pid == 0:\n"
    "            time.sleep(30)\n"
    "            os._exit(0)\n"
    "        kids.append(pid)\n"
    "except OSError as exc:\n"
    "    print('refused', exc.errno, flush=True)\n"
    "print(len(kids), flush=True)\n"
    "time.sleep(4)\n"
)


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_the_fork_cap_holds_under_the_sandboxes_own_uid_and_is_recorded(
    target: Target, tmp_path: Path
) -> None:
    mgr, _ = manager(target, tmp_path)
    cfg = target.config(quotas={"process_count_limit": 20, "poll_interval_ms": 300})
    with pytest.raises(QuotaExceededError) as info:
        mgr.run_in_sandbox(["python3", "-c", FORKS], cfg)
    assert info.value.violation.type == ViolationType.PROCESS_COUNT_EXCEEDED
    assert info.value.outcome is not None
    refused, forked = info.value.outcome.result.stdout.text.split("\n")[:2]
    assert refused == "refused 11"  # EAGAIN: RLIMIT_NPROC held
    assert int(forked) <= 20  # the task: its python and at most limit more, less one
    mgr.shutdown()


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_an_exec_timeout_kills_that_execs_whole_tree_and_the_sandbox_stays_usable(
    target: Target, tmp_path: Path
) -> None:
    mgr, driver = manager(target, tmp_path)
    with mgr.open_sandbox(target.config()) as sandbox:
        sandbox.exec("sleep 400 >/dev/null 2>&1 &")  # an earlier exec's background process
        r = sandbox.exec(
            "setsid sleep 301 >/dev/null 2>&1 & (sleep 302 >/dev/null 2>&1 &); "
            "sh -c 'sleep 303 & sleep 304'",
            timeout_s=1.5,
        )
        assert r.timed_out and r.exit_code == 137
        left = processes(driver, sandbox.context)
        assert any(line.endswith("sleep 400") for line in left), left
        assert not [line for line in left if " sleep 30" in line], left  # the whole tree
        assert sandbox.exec("echo usable").stdout.text == "usable\n"
    mgr.shutdown()


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_force_stop_kills_every_task_process_and_the_pod_stays_inspectable(target: Target) -> None:
    driver = target.driver()
    ctx = driver.provision(target.config())
    driver.exec(
        ctx, ExecRequest.of("sleep 401 >/dev/null 2>&1 & setsid sleep 402 >/dev/null 2>&1 &")
    )
    assert any("sleep 402" in line for line in processes(driver, ctx))
    driver.force_stop(ctx)
    core = target.core()
    assert core.read_namespaced_pod(ctx.labels["pod"], target.namespace).status.phase == "Running"
    left = processes(driver, ctx)
    assert not [line for line in left if "sleep 40" in line], left
    assert driver.exec(
        ctx, ExecRequest.of("cat /proc/1/cmdline | tr '\\0' ' '")
    ).stdout.text.startswith("/bin/sh -c trap")
    driver.destroy(ctx)


# -- pods that never run ------------------------------------------------------------------------
def _answer_first_pod(target: Target, status: dict[str, Any]) -> None:
    """Act as the scheduler and kubelet for the one pod the driver creates."""
    core = target.core()
    pod = wait_for(lambda: core.list_namespaced_pod(target.namespace).items, "the driver's pod")[0]
    core.patch_namespaced_pod_status(pod.metadata.name, target.namespace, {"status": status})


@pytest.mark.parametrize(
    ("status", "error", "text"),
    [
        (
            {
                "containerStatuses": [
                    {
                        "name": "sandbox",
                        "image": "x",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "waiting": {"reason": "ErrImagePull", "message": "no such image"}
                        },
                    }
                ]
            },
            "ImageUnavailableError",
            "ErrImagePull: no such image",
        ),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient memory.",
                    }
                ]
            },
            "CapacityError",
            "Insufficient memory",
        ),
    ],
    ids=["image", "unschedulable"],
)
def test_a_pod_that_cannot_run_fails_with_the_clusters_reason(
    cluster: Any, status: dict[str, Any], error: str, text: str
) -> None:
    target = Target(cluster.kubeconfig, cluster.context, cluster.namespace, emulator=cluster.api)
    driver = target.driver()
    failures: list[BaseException] = []

    def provision() -> None:
        try:
            driver.provision(target.config(kubernetes={"start_timeout_s": 2}))
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=provision)
    t.start()
    _answer_first_pod(target, status)
    t.join(60)
    assert [type(f).__name__ for f in failures] == [error]
    assert text in str(failures[0])
    driver.close()
    assert wait_for_empty(target) == []  # its pod, then (collected) policy and lease


# -- the network ----------------------------------------------------------------------------------
@pytest.mark.docker
def test_network_is_given_only_when_asked_and_an_unenforced_policy_refuses_the_run(
    emulated: Target, kubelet: Any
) -> None:
    driver = emulated.driver()
    opened = driver.provision(emulated.config(network=True))
    assert "network-policy" not in opened.isolation and "net-namespace" not in opened.isolation
    ifaces = driver.exec(opened, ExecRequest.of("ls /sys/class/net")).stdout.text.split()
    assert "lo" in ifaces and len(ifaces) == 2
    driver.destroy(opened)

    kubelet._denied = lambda pod: False  # a CNI that ignores NetworkPolicy
    with pytest.raises(WeakerIsolationError, match="net-namespace"):
        driver.provision(emulated.config())
    weaker = driver.provision(emulated.config(isolation={"allow_weaker_isolation": True}))
    assert "network-policy" not in weaker.isolation and "net-namespace" not in weaker.isolation
    assert any(w.startswith("net-namespace: ") for w in weaker.warnings)
    driver.destroy(weaker)

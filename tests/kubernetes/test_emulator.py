"""Contract of the emulated Kubernetes stack, through the official ``kubernetes`` client.

What the Kubernetes driver's tests will rely on: the API server answers as a real one does
(status codes, Status bodies, resourceVersion, selectors, watches, patches, quota, GC), and
the test kubelet turns pods into real containers whose limits, users, tmpfs volumes,
deadlines and exec streams behave as on a node. Every test reaches the emulator through a
kubeconfig file, as the driver will.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes.stream import stream

from kubernetes import client, config, watch
from tests.kubernetes.conftest import TOKEN
from tests.kubernetes.emulator import Quota, write_kubeconfig

pytestmark = pytest.mark.kubernetes

WAIT_S = 30.0  # a pod starts in well under a second; a loaded CI host may be slower


def wait_for(predicate: Callable[[], Any], timeout_s: float = WAIT_S, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.05)


def pod(
    name: str,
    command: list[str] | None = None,
    *,
    labels: dict[str, str] | None = None,
    memory: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "devs-sandbox/default"}
    if command is not None:
        container["command"] = command
    if memory is not None:
        container["resources"] = {"limits": {"memory": memory}}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            **spec,
        },
    }


def body_of(exc: client.ApiException) -> dict[str, Any]:
    return json.loads(exc.body)


def raw_call(
    cluster: Any, method: str, path: str, body: Any = None, query: str = ""
) -> tuple[int, Any, Any]:
    """A request without the official client's own checks: (code, JSON body, headers)."""
    request = urllib.request.Request(  # noqa: S310 (the emulator's http URL)
        cluster.url + path + query,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as resp:  # noqa: S310 (http only)
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def api_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> client.ApiException:
    with pytest.raises(client.ApiException) as info:
        fn(*args, **kwargs)
    return info.value


# -- reaching it ---------------------------------------------------------------------------
def test_kubeconfig_reaches_the_emulator_with_its_context_and_token(cluster, tmp_path):
    loader = client.Configuration()
    config.load_kube_config(
        config_file=str(cluster.kubeconfig), context=cluster.context, client_configuration=loader
    )
    with client.ApiClient(loader) as api:
        names = [ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items]
    assert cluster.namespace in names
    _, active = config.list_kube_config_contexts(str(cluster.kubeconfig))
    assert active["context"]["namespace"] == cluster.namespace

    wrong = write_kubeconfig(
        str(tmp_path / "wrong"),
        cluster.url,
        context="c",
        namespace=cluster.namespace,
        token="wrong-token",
    )
    with config.new_client_from_config(wrong.path, context="c") as api:
        err = api_error(client.CoreV1Api(api).list_namespace)
    assert err.status == 401
    assert body_of(err)["reason"] == "Unauthorized"


# -- objects, versions, errors ------------------------------------------------------------
def test_every_write_takes_a_new_resource_version_and_lists_carry_one(cluster, core):
    ns = cluster.namespace
    versions = [
        int(core.create_namespaced_pod(ns, pod(f"p{i}")).metadata.resource_version)
        for i in range(3)
    ]
    assert versions == sorted(versions) and len(set(versions)) == 3
    patched = core.patch_namespaced_pod("p0", ns, {"metadata": {"labels": {"x": "1"}}})
    assert int(patched.metadata.resource_version) > versions[-1]
    listed = core.list_namespaced_pod(ns)
    assert int(listed.metadata.resource_version) >= int(patched.metadata.resource_version)
    assert (
        core.read_namespaced_pod("p0", ns).metadata.resource_version
        == patched.metadata.resource_version
    )
    # a patch that changes nothing is not a write
    again = core.patch_namespaced_pod("p0", ns, {"metadata": {"labels": {"x": "1"}}})
    assert again.metadata.resource_version == patched.metadata.resource_version
    generated = core.create_namespaced_pod(ns, {**pod(""), "metadata": {"generateName": "g-"}})
    assert generated.metadata.name.startswith("g-") and len(generated.metadata.name) == 7
    assert generated.status.phase == "Pending"


def test_already_exists_and_not_found_answer_the_real_status(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("dup"))
    err = api_error(core.create_namespaced_pod, ns, pod("dup"))
    assert err.status == 409
    assert body_of(err) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "dup" already exists',
        "reason": "AlreadyExists",
        "details": {"name": "dup", "kind": "pods"},
        "code": 409,
    }
    err = api_error(core.read_namespaced_pod, "ghost", ns)
    assert err.status == 404
    assert body_of(err)["reason"] == "NotFound"
    assert body_of(err)["message"] == 'pods "ghost" not found'
    err = api_error(core.create_namespaced_pod, "no-such-ns", pod("p"))
    assert err.status == 404
    assert body_of(err)["message"] == 'namespaces "no-such-ns" not found'


def test_a_stale_resource_version_conflicts_on_replace_and_patch(cluster, core):
    ns = cluster.namespace
    created = core.create_namespaced_pod(ns, pod("p", labels={"v": "1"}))
    stale = created.metadata.resource_version
    core.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"v": "2"}}})

    current = core.read_namespaced_pod("p", ns)
    current.metadata.resource_version = stale
    err = api_error(core.replace_namespaced_pod, "p", ns, current)
    assert err.status == 409
    assert body_of(err)["reason"] == "Conflict"
    assert body_of(err)["message"] == (
        'Operation cannot be fulfilled on pods "p": the object has been modified; please '
        "apply your changes to the latest version and try again"
    )
    err = api_error(
        core.patch_namespaced_pod,
        "p",
        ns,
        {"metadata": {"resourceVersion": stale, "labels": {"v": "3"}}},
    )
    assert err.status == 409
    # without a resourceVersion an update is unconditional (pods allow it)
    current.metadata.resource_version = None
    current.metadata.labels = {"v": "4"}
    assert core.replace_namespaced_pod("p", ns, current).metadata.labels == {"v": "4"}


def test_a_failed_json_patch_test_is_422_and_changes_nothing(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", labels={"state": "warm"}))
    before = core.read_namespaced_pod("p", ns).metadata.resource_version
    err = api_error(
        core.patch_namespaced_pod,
        "p",
        ns,
        [
            {"op": "test", "path": "/metadata/labels/state", "value": "claimed"},
            {"op": "replace", "path": "/metadata/labels/state", "value": "mine"},
        ],
    )
    assert err.status == 422
    assert body_of(err)["reason"] == "Invalid"
    assert core.read_namespaced_pod("p", ns).metadata.resource_version == before
    ok = core.patch_namespaced_pod(
        "p",
        ns,
        [
            {"op": "test", "path": "/metadata/labels/state", "value": "warm"},
            {"op": "replace", "path": "/metadata/labels/state", "value": "claimed"},
        ],
    )
    assert ok.metadata.labels["state"] == "claimed"


@pytest.mark.parametrize("guard", ["resourceVersion", "test-op"])
def test_a_warm_pool_claim_race_has_exactly_one_winner(cluster, core, guard):
    """Claimers read the same pod, then race a JSON patch guarded by the resourceVersion
    they read (losers: 409 Conflict) or by a ``test`` of the label (losers: 422)."""
    ns = cluster.namespace
    rv = core.create_namespaced_pod(
        ns, pod("warm-1", labels={"pool": "warm"})
    ).metadata.resource_version
    claimers = 6
    barrier = threading.Barrier(claimers)
    results: list[int] = []
    lock = threading.Lock()

    def claim(i: int) -> None:
        with cluster.client() as api:
            mine = client.CoreV1Api(api)
            ops = [{"op": "replace", "path": "/metadata/labels/pool", "value": f"claimed-{i}"}]
            if guard == "resourceVersion":
                ops.insert(0, {"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
            else:
                ops.insert(0, {"op": "test", "path": "/metadata/labels/pool", "value": "warm"})
            barrier.wait()
            try:
                mine.patch_namespaced_pod("warm-1", ns, ops)
                code = 200
            except client.ApiException as exc:
                code = exc.status
            with lock:
                results.append(code)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    loser = 409 if guard == "resourceVersion" else 422
    assert sorted(results) == [200] + [loser] * (claimers - 1)
    assert core.read_namespaced_pod("warm-1", ns).metadata.labels["pool"].startswith("claimed-")


def test_merge_and_strategic_merge_patches(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", labels={"a": "1", "b": "2"}))
    for content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        out = core.patch_namespaced_pod(
            "p", ns, {"metadata": {"labels": {"a": None, "c": "3"}}}, _content_type=content_type
        )
        assert out.metadata.labels == {"b": "2", "c": "3"}
        core.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"a": "1"}}})


def test_pod_spec_is_immutable_but_deadline_may_be_set_and_lowered(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", ["sleep", "1"]))
    err = api_error(
        core.patch_namespaced_pod,
        "p",
        ns,
        [{"op": "replace", "path": "/spec/containers/0/command", "value": ["sleep", "2"]}],
    )
    assert err.status == 422
    assert "pod updates may not change fields" in body_of(err)["message"]
    assert (
        core.patch_namespaced_pod(
            "p", ns, {"spec": {"activeDeadlineSeconds": 60}}
        ).spec.active_deadline_seconds
        == 60
    )
    assert (
        core.patch_namespaced_pod(
            "p", ns, {"spec": {"activeDeadlineSeconds": 30}}
        ).spec.active_deadline_seconds
        == 30
    )
    err = api_error(core.patch_namespaced_pod, "p", ns, {"spec": {"activeDeadlineSeconds": 90}})
    assert err.status == 422


def test_status_goes_through_the_status_subresource_only(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p"))
    ignored = core.patch_namespaced_pod("p", ns, {"status": {"phase": "Running"}})
    assert ignored.status.phase == "Pending"
    done = core.patch_namespaced_pod_status("p", ns, {"status": {"phase": "Running"}})
    assert done.status.phase == "Running"
    assert core.read_namespaced_pod_status("p", ns).status.phase == "Running"


# -- selectors and watches -----------------------------------------------------------------
def test_label_and_field_selectors(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("a", labels={"app": "x", "tier": "1"}))
    core.create_namespaced_pod(ns, pod("b", labels={"app": "y"}))
    core.create_namespaced_pod(ns, pod("c", labels={"app": "x", "tier": "2"}))

    def names(**kw: Any) -> list[str]:
        return [p.metadata.name for p in core.list_namespaced_pod(ns, **kw).items]

    assert names(label_selector="app=x") == ["a", "c"]
    assert names(label_selector="app!=x") == ["b"]
    assert names(label_selector="app in (x,y),tier notin (2)") == ["a", "b"]
    assert names(label_selector="tier") == ["a", "c"]
    assert names(label_selector="!tier") == ["b"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b,status.phase=Pending") == ["a", "c"]
    err = api_error(core.list_namespaced_pod, ns, field_selector="spec.bogus=1")
    assert err.status == 400
    assert body_of(err)["message"] == "field label not supported: spec.bogus"
    assert [
        p.metadata.name for p in core.list_pod_for_all_namespaces(label_selector="app=y").items
    ] == ["b"]


def test_a_watch_honours_selectors_and_its_timeout(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("in", labels={"app": "x"}))
    core.create_namespaced_pod(ns, pod("out", labels={"app": "y"}))
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    seen: list[tuple[str, str]] = []

    def watch_it() -> None:
        for ev in watch.Watch().stream(
            core.list_namespaced_pod,
            ns,
            label_selector="app=x",
            resource_version=rv,
            timeout_seconds=2,
        ):
            seen.append((ev["type"], ev["object"].metadata.name))

    t = threading.Thread(target=watch_it)
    started = time.monotonic()
    t.start()
    time.sleep(0.3)
    core.patch_namespaced_pod("out", ns, {"metadata": {"labels": {"app": "x"}}})  # moves in
    core.patch_namespaced_pod("in", ns, {"metadata": {"labels": {"app": "z"}}})  # moves out
    core.patch_namespaced_pod("out", ns, {"metadata": {"annotations": {"k": "v"}}})
    t.join(WAIT_S)
    assert not t.is_alive()
    assert time.monotonic() - started < 10  # ended by timeoutSeconds, not by the client
    assert seen == [("ADDED", "out"), ("DELETED", "in"), ("MODIFIED", "out")]


def test_a_watch_without_resource_version_starts_with_the_current_state(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("a"))
    events = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_pod, ns, field_selector="metadata.name=a", timeout_seconds=1
        )
    ]
    assert events == [("ADDED", "a")]


def test_a_watch_from_a_compacted_resource_version_gets_410(cluster, core):
    ns = cluster.namespace
    old = core.create_namespaced_pod(ns, pod("a")).metadata.resource_version
    core.patch_namespaced_pod("a", ns, {"metadata": {"labels": {"n": "1"}}})
    cluster.api.compact()
    err = api_error(
        lambda: list(
            watch.Watch().stream(
                core.list_namespaced_pod, ns, resource_version=old, timeout_seconds=5
            )
        )
    )
    assert err.status == 410
    assert err.reason.startswith("Expired: too old resource version")


def test_expire_watches_ends_an_open_watch_with_an_error_event(cluster, core):
    ns = cluster.namespace
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    outcome: list[Any] = []

    def watch_it() -> None:
        try:
            for _ in watch.Watch().stream(
                core.list_namespaced_pod, ns, resource_version=rv, timeout_seconds=20
            ):
                pass
            outcome.append("ended")
        except client.ApiException as exc:
            outcome.append(exc.status)

    t = threading.Thread(target=watch_it)
    t.start()
    wait_for(lambda: cluster.api.store._watchers, what="the watch to open")
    assert cluster.api.expire_watches() == 1
    t.join(WAIT_S)
    assert outcome == [410]


# -- deletion, GC, quota, faults -----------------------------------------------------------
def test_delete_twice_answers_404_the_second_time(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p"))
    assert core.delete_namespaced_pod("p", ns).metadata.name == "p"
    err = api_error(core.delete_namespaced_pod, "p", ns)
    assert err.status == 404


def test_a_bound_pod_is_deleted_gracefully_until_its_kubelet_confirms(cluster, core):
    ns = cluster.namespace
    uid = core.create_namespaced_pod(ns, pod("p")).metadata.uid
    core.create_namespaced_pod_binding(
        "p",
        ns,
        {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "nowhere"}},
        _preload_content=False,
    )
    assert core.read_namespaced_pod("p", ns).spec.node_name == "nowhere"
    first = core.delete_namespaced_pod("p", ns, grace_period_seconds=30)
    assert first.metadata.deletion_timestamp is not None
    assert first.metadata.deletion_grace_period_seconds == 30
    again = core.delete_namespaced_pod("p", ns)  # a second delete of a terminating pod
    assert again.metadata.deletion_timestamp is not None
    err = api_error(
        core.delete_namespaced_pod,
        "p",
        ns,
        body=client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid="not-" + uid)
        ),
    )
    assert err.status == 409 and "Precondition failed: UID" in body_of(err)["message"]
    core.delete_namespaced_pod(
        "p",
        ns,
        body=client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
        ),
    )
    assert api_error(core.read_namespaced_pod, "p", ns).status == 404


def test_delete_collection_by_label(cluster, core):
    ns = cluster.namespace
    for name, owner in (("a", "me"), ("b", "me"), ("c", "other")):
        core.create_namespaced_pod(ns, pod(name, labels={"owner": owner}))
    core.delete_collection_namespaced_pod(ns, label_selector="owner=me")
    assert [p.metadata.name for p in core.list_namespaced_pod(ns).items] == ["c"]


def test_deleting_a_namespace_terminates_it_and_everything_in_it(cluster, api_client, core):
    core.create_namespace({"metadata": {"name": "doomed"}})
    core.create_namespaced_pod("doomed", pod("p"))
    client.CoordinationV1Api(api_client).create_namespaced_lease(
        "doomed", {"metadata": {"name": "l"}}
    )
    core.delete_namespace("doomed")
    err = api_error(core.create_namespaced_pod, "doomed", pod("q"))
    assert err.status in (403, 404)  # Terminating (403), or already gone (404)
    wait_for(
        lambda: "doomed" not in [n.metadata.name for n in core.list_namespace().items],
        what="the namespace to go",
    )
    assert core.list_pod_for_all_namespaces(field_selector="metadata.namespace=doomed").items == []


def owned_by(lease: Any) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "name": lease.metadata.name,
            "uid": lease.metadata.uid,
        }
    ]


def test_deleting_a_lease_collects_the_pods_it_owns(cluster, api_client, core):
    ns = cluster.namespace
    leases = client.CoordinationV1Api(api_client)
    lease = leases.create_namespaced_lease(
        ns, {"metadata": {"name": "owner"}, "spec": {"holderIdentity": "me"}}
    )
    keep = leases.create_namespaced_lease(ns, {"metadata": {"name": "keep"}})
    for name in ("a", "b"):
        core.create_namespaced_pod(
            ns, {**pod(name), "metadata": {"name": name, "ownerReferences": owned_by(lease)}}
        )
    core.create_namespaced_pod(
        ns, {**pod("kept"), "metadata": {"name": "kept", "ownerReferences": owned_by(keep)}}
    )
    core.create_namespaced_pod(ns, pod("free"))
    leases.delete_namespaced_lease("owner", ns)
    wait_for(
        lambda: (
            sorted(p.metadata.name for p in core.list_namespaced_pod(ns).items) == ["free", "kept"]
        ),
        what="the garbage collector",
    )

    leases.delete_namespaced_lease("keep", ns, propagation_policy="Orphan")
    time.sleep(0.5)  # several GC sweeps
    kept = core.read_namespaced_pod("kept", ns)
    assert not kept.metadata.owner_references


def test_a_quota_refuses_the_pod_beyond_it_with_403(cluster, core):
    ns = cluster.namespace
    cluster.api.quotas.append(Quota({"pods": "2"}, name="sandboxes", namespace=ns))
    core.create_namespaced_pod(ns, pod("a"))
    core.create_namespaced_pod(ns, pod("b"))
    err = api_error(core.create_namespaced_pod, ns, pod("c"))
    assert err.status == 403
    assert body_of(err)["reason"] == "Forbidden"
    assert body_of(err)["message"] == (
        'pods "c" is forbidden: exceeded quota: sandboxes, requested: pods=1, used: pods=2, '
        "limited: pods=2"
    )
    core.patch_namespaced_pod_status("a", ns, {"status": {"phase": "Succeeded"}})
    core.create_namespaced_pod(ns, pod("c"))  # a finished pod no longer counts

    cluster.api.quotas[:] = [Quota({"requests.memory": "96Mi"}, name="mem")]
    err = api_error(core.create_namespaced_pod, ns, pod("d"))
    assert body_of(err)["message"] == (
        'pods "d" is forbidden: failed quota: mem: must specify requests.memory'
    )
    core.create_namespaced_pod(ns, pod("d", memory="64Mi"))
    err = api_error(core.create_namespaced_pod, ns, pod("e", memory="64Mi"))
    assert err.status == 403
    assert (
        "exceeded quota: mem, requested: requests.memory=64Mi, used: "
        "requests.memory=64Mi, limited: requests.memory=96Mi" in body_of(err)["message"]
    )


def test_fail_next_answers_one_request_with_the_given_code(cluster, core):
    ns = cluster.namespace
    cluster.api.fail_next("create", "pods", 500)
    err = api_error(core.create_namespaced_pod, ns, pod("p"))
    assert err.status == 500 and body_of(err)["reason"] == "InternalError"
    core.create_namespaced_pod(ns, pod("p"))
    cluster.api.fail_next("delete", "pods", 503, times=2)
    for _ in range(2):
        assert api_error(core.delete_namespaced_pod, "p", ns).status == 503
    core.delete_namespaced_pod("p", ns)


def test_validation_refuses_what_a_server_refuses(cluster, core):
    ns = cluster.namespace
    pids = pod("p")
    pids["spec"]["containers"][0]["resources"] = {"limits": {"pids": "64"}}
    err = api_error(core.create_namespaced_pod, ns, pids)
    assert err.status == 422
    assert (
        'limits[pids]: Invalid value: "pids": must be a standard resource'
        in body_of(err)["message"]
    )
    assert api_error(core.create_namespaced_pod, ns, pod("p", memory="2 GiB")).status == 400
    bad_label = pod("p", labels={"id": "x" * 64})
    assert api_error(core.create_namespaced_pod, ns, bad_label).status == 422

    # The official client refuses unknown fields itself (pydantic); a dict sent raw gets
    # the server's treatment.
    typo = pod("p")
    typo["spec"]["containers"][0]["securityContxt"] = {"runAsUser": 1}
    code, answer, _ = raw_call(
        cluster, "POST", f"/api/v1/namespaces/{ns}/pods", typo, "?fieldValidation=Strict"
    )
    assert code == 400 and "strict decoding error" in answer["message"]
    code, created, headers = raw_call(cluster, "POST", f"/api/v1/namespaces/{ns}/pods", typo)
    assert code == 201  # the default, Warn: dropped, with a warning
    assert "securityContxt" not in created["spec"]["containers"][0]
    assert headers["Warning"].startswith('299 - "unknown field')
    assert cluster.api.warnings == ['unknown field "spec.containers[0].securityContxt"']


def test_network_policies_and_leases_have_versions_and_conflicts(cluster, api_client):
    ns = cluster.namespace
    net = client.NetworkingV1Api(api_client)
    policy = net.create_namespaced_network_policy(
        ns, {"metadata": {"name": "deny"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    )
    stale = policy.metadata.resource_version
    policy.spec.pod_selector = client.V1LabelSelector(match_labels={"a": "b"})
    replaced = net.replace_namespaced_network_policy("deny", ns, policy)
    assert int(replaced.metadata.resource_version) > int(stale)
    policy.metadata.resource_version = stale
    assert api_error(net.replace_namespaced_network_policy, "deny", ns, policy).status == 409
    assert [p.metadata.name for p in net.list_namespaced_network_policy(ns).items] == ["deny"]
    net.delete_namespaced_network_policy("deny", ns)
    assert api_error(net.read_namespaced_network_policy, "deny", ns).status == 404

    leases = client.CoordinationV1Api(api_client)
    lease = leases.create_namespaced_lease(
        ns, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 10}}
    )
    lease.spec.holder_identity = "b"
    renewed = leases.replace_namespaced_lease("l", ns, lease)
    assert renewed.spec.holder_identity == "b"
    lease.spec.holder_identity = "c"  # still carries the version before the renewal
    err = api_error(leases.replace_namespaced_lease, "l", ns, lease)
    assert err.status == 409
    assert body_of(err)["details"] == {
        "name": "l",
        "group": "coordination.k8s.io",
        "kind": "leases",
    }
    assert api_error(leases.create_namespaced_lease, ns, {"metadata": {"name": "l"}}).status == 409
    leases.delete_namespaced_lease("l", ns)


def test_exec_needs_a_pod_on_a_node(cluster, core):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p"))
    err = api_error(
        stream,
        core.connect_get_namespaced_pod_exec,
        "p",
        ns,
        command=["true"],
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
    )
    assert "400" in str(err.reason)


# -- with the kubelet: real containers ------------------------------------------------------
def wait_phase(core: Any, name: str, ns: str, *phases: str) -> Any:
    def reached() -> Any:
        found = core.read_namespaced_pod(name, ns)
        return found if found.status.phase in phases else None

    return wait_for(reached, what=f"pod {name} in {phases}")


def waiting_reason(core: Any, name: str, ns: str, reason: str) -> Any:
    """The container's waiting state once its reason is ``reason``."""

    def reached() -> Any:
        statuses = core.read_namespaced_pod(name, ns).status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting if waiting is not None and waiting.reason == reason else None

    return wait_for(reached, what=f"pod {name} waiting with {reason}")


def exec_ws(core: Any, name: str, ns: str, command: list[str], **kw: Any) -> Any:
    return stream(
        core.connect_get_namespaced_pod_exec,
        name,
        ns,
        command=command,
        stdin=kw.pop("stdin", False),
        stdout=True,
        stderr=True,
        tty=False,
        _preload_content=False,
        **kw,
    )


def run_exec(core: Any, name: str, ns: str, command: list[str]) -> tuple[str, str, int]:
    ws = exec_ws(core, name, ns, command)
    ws.run_forever(timeout=WAIT_S)
    assert not ws.is_open(), f"exec of {command} did not finish"
    return ws.read_stdout(timeout=0), ws.read_stderr(timeout=0), ws.returncode


SLEEPER = ["sleep", "600"]


@pytest.mark.docker
def test_a_pod_runs_to_completion_and_reports_it(cluster, core, kubelet):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("ok", ["sh", "-c", "echo hello"]))
    core.create_namespaced_pod(ns, pod("bad", ["sh", "-c", "exit 7"]))
    done = wait_phase(core, "ok", ns, "Succeeded")
    term = done.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (0, "Completed")
    assert done.spec.node_name == kubelet.node_name
    assert core.read_namespaced_pod_log("ok", ns) == "hello\n"
    failed = wait_phase(core, "bad", ns, "Failed")
    term = failed.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (7, "Error")


@pytest.mark.docker
def test_exec_streams_stdin_to_eof_and_reports_the_exit_code(cluster, core, kubelet):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", SLEEPER))
    wait_phase(core, "p", ns, "Running")
    ws = exec_ws(core, "p", ns, ["sh", "-c", "cat; echo done >&2; exit 3"], stdin=True)
    assert ws.subprotocol == "v5.channel.k8s.io"
    ws.write_stdin("line one\n")
    ws.write_stdin(b"\x00binary\n")
    ws.close_channel(0)  # v5: [255, 0] closes stdin: cat sees EOF
    ws.run_forever(timeout=WAIT_S)
    assert not ws.is_open(), "cat did not see the end of stdin"
    assert ws.read_stdout(timeout=0) == "line one\n\x00binary\n"
    assert ws.read_stderr(timeout=0) == "done\n"
    assert ws.returncode == 3

    raw = exec_ws(core, "p", ns, ["sh", "-c", "exit 5"])
    raw.run_forever(timeout=WAIT_S)
    sent = json.loads(raw.read_channel(3))
    assert sent["status"] == "Failure" and sent["reason"] == "NonZeroExitCode"
    assert sent["details"]["causes"] == [{"reason": "ExitCode", "message": "5"}]
    ok = exec_ws(core, "p", ns, ["true"])
    ok.run_forever(timeout=WAIT_S)
    assert json.loads(ok.read_channel(3)) == {"metadata": {}, "status": "Success"}

    v4 = exec_ws(
        core,
        "p",
        ns,
        ["sh", "-c", "echo four; exit 4"],
        _headers={"sec-websocket-protocol": "v4.channel.k8s.io"},
    )
    v4.run_forever(timeout=WAIT_S)
    assert v4.subprotocol == "v4.channel.k8s.io"
    assert (v4.read_stdout(timeout=0), v4.returncode) == ("four\n", 4)

    missing = exec_ws(core, "p", ns, ["no-such-binary"])
    missing.run_forever(timeout=WAIT_S)
    failure = json.loads(missing.read_channel(3))
    assert failure["reason"] == "InternalError"
    assert "executable file not found" in failure["message"]

    cluster.api.drop_next_exec_status()
    lost = exec_ws(core, "p", ns, ["true"])
    lost.run_forever(timeout=WAIT_S)
    assert lost.read_channel(3) == ""


@pytest.mark.docker
def test_closing_the_exec_websocket_leaves_the_process_running(cluster, core, kubelet):
    ns = cluster.namespace
    spec = pod("p", SLEEPER, securityContext={"runAsUser": 1000, "runAsGroup": 1000})
    core.create_namespaced_pod(ns, spec)
    wait_phase(core, "p", ns, "Running")
    ws = exec_ws(core, "p", ns, ["sleep", "300"])
    ws.update(timeout=0.5)
    ws.close()
    count = "grep -l '^sleep$' /proc/[0-9]*/comm | wc -l"

    def sleepers() -> str:
        return run_exec(core, "p", ns, ["sh", "-c", count])[0].strip()

    wait_for(lambda: sleepers() == "2", what="pid 1 and the orphaned exec")
    run_exec(core, "p", ns, ["sh", "-c", "kill -KILL -1"])
    wait_for(lambda: sleepers() == "1", what="kill -1 as the pod's uid to spare only pid 1")
    assert core.read_namespaced_pod("p", ns).status.phase == "Running"


@pytest.mark.docker
def test_security_context_and_limits_reach_the_container(cluster, core, kubelet):
    ns = cluster.namespace
    spec = pod(
        "p",
        SLEEPER,
        memory="64Mi",
        securityContext={
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "runAsNonRoot": True,
            "supplementalGroups": [4242],
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        container={
            "securityContext": {
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
            "resources": {"limits": {"memory": "64Mi", "cpu": "500m"}},
        },
    )
    core.create_namespaced_pod(ns, spec)
    running = wait_phase(core, "p", ns, "Running")
    cid = running.status.container_statuses[0].container_id.removeprefix("docker://")
    out, _, code = run_exec(
        core,
        "p",
        ns,
        [
            "sh",
            "-c",
            (
                "id -u; id -g; id -G; grep -E '^(NoNewPrivs|Seccomp|CapEff):' /proc/self/status; "
                "touch /x 2>&1; exit 0"
            ),
        ],
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[:2] == ["65534", "65534"]
    assert "4242" in lines[2].split()
    assert "NoNewPrivs:\t1" in lines and "Seccomp:\t2" in lines
    assert "CapEff:\t0000000000000000" in lines
    assert "Read-only file system" in lines[-1]
    host = kubelet.engine.api.inspect_container(cid)["HostConfig"]
    assert host["Memory"] == host["MemorySwap"] == 64 * 1024 * 1024
    assert host["NanoCpus"] == 500_000_000
    assert host["CapDrop"] == ["ALL"]
    assert host["NetworkMode"] == "bridge"


@pytest.mark.docker
def test_run_as_non_root_with_a_root_image_is_a_config_error(cluster, core, kubelet):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", SLEEPER, securityContext={"runAsNonRoot": True}))
    waiting = waiting_reason(core, "p", ns, "CreateContainerConfigError")
    assert "runAsNonRoot and image will run as root" in waiting.message
    core.create_namespaced_pod(ns, pod("h", SLEEPER, hostNetwork=True))
    refused = wait_phase(core, "h", ns, "Failed")
    assert refused.status.reason == "Unsupported"


@pytest.mark.docker
def test_pid1_oom_kill_shows_as_oomkilled(cluster, core, kubelet):
    ns = cluster.namespace
    hog = ["python3", "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"]
    core.create_namespaced_pod(ns, pod("p", hog, memory="32Mi"))
    failed = wait_phase(core, "p", ns, "Failed")
    term = failed.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (137, "OOMKilled")


@pytest.mark.docker
def test_an_exec_oom_kill_is_137_and_not_in_the_pod_status(cluster, core, kubelet):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", SLEEPER, memory="48Mi"))
    wait_phase(core, "p", ns, "Running")
    _, _, code = run_exec(
        core, "p", ns, ["python3", "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"]
    )
    assert code == 137
    after = core.read_namespaced_pod("p", ns)
    assert after.status.phase == "Running"
    assert after.status.container_statuses[0].state.running is not None


@pytest.mark.docker
def test_a_memory_empty_dir_fills_up_with_enospc(cluster, core, kubelet):
    ns = cluster.namespace
    spec = pod(
        "p",
        SLEEPER,
        memory="64Mi",
        volumes=[{"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}}],
        container={
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            "securityContext": {"readOnlyRootFilesystem": True},
        },
    )
    core.create_namespaced_pod(ns, spec)
    wait_phase(core, "p", ns, "Running")
    out, err, code = run_exec(
        core,
        "p",
        ns,
        [
            "sh",
            "-c",
            ("grep ' /scratch ' /proc/mounts; dd if=/dev/zero of=/scratch/f bs=1M count=16"),
        ],
    )
    assert "tmpfs" in out and "size=8192k" in out
    assert code != 0 and "No space left on device" in err


@pytest.mark.docker
def test_active_deadline_fails_the_pod_with_deadline_exceeded(cluster, core, kubelet):
    ns = cluster.namespace
    core.create_namespaced_pod(ns, pod("p", SLEEPER, activeDeadlineSeconds=1))
    failed = wait_phase(core, "p", ns, "Failed")
    assert failed.status.reason == "DeadlineExceeded"
    assert failed.status.container_statuses[0].state.terminated.exit_code == 137


@pytest.mark.docker
def test_deleting_a_pod_removes_its_container(cluster, core, kubelet):
    ns = cluster.namespace
    lease = client.CoordinationV1Api(core.api_client).create_namespaced_lease(
        ns, {"metadata": {"name": "owner"}}
    )
    core.create_namespaced_pod(ns, pod("p", SLEEPER))
    core.create_namespaced_pod(
        ns, {**pod("q", SLEEPER), "metadata": {"name": "q", "ownerReferences": owned_by(lease)}}
    )
    cids = [
        wait_phase(core, n, ns, "Running")
        .status.container_statuses[0]
        .container_id.removeprefix("docker://")
        for n in ("p", "q")
    ]
    core.delete_namespaced_pod("p", ns)
    client.CoordinationV1Api(core.api_client).delete_namespaced_lease("owner", ns)
    wait_for(lambda: not core.list_namespaced_pod(ns).items, what="both pods to go")
    left = kubelet.engine.api.containers(
        all=True, filters={"id": cids[0]}
    ) + kubelet.engine.api.containers(all=True, filters={"id": cids[1]})
    assert left == []
    assert api_error(core.delete_namespaced_pod, "p", ns).status == 404


@pytest.mark.docker
def test_a_deny_all_egress_policy_takes_the_network_away(cluster, core, kubelet):
    ns = cluster.namespace
    net = client.NetworkingV1Api(core.api_client)
    core.create_namespaced_pod(ns, pod("p", SLEEPER, labels={"sandbox": "s1"}))
    wait_phase(core, "p", ns, "Running")

    def interfaces() -> list[str]:
        return sorted(run_exec(core, "p", ns, ["ls", "/sys/class/net"])[0].split())

    assert "eth0" in interfaces()
    net.create_namespaced_network_policy(
        ns,
        {
            "metadata": {"name": "deny"},
            "spec": {
                "podSelector": {"matchLabels": {"sandbox": "s1"}},
                "policyTypes": ["Ingress", "Egress"],
            },
        },
    )
    wait_for(lambda: interfaces() == ["lo"], what="the pod to lose its network")
    net.delete_namespaced_network_policy("deny", ns)
    wait_for(lambda: len(interfaces()) == 2, what="the network to come back")  # lo, eth<n>


@pytest.mark.docker
def test_the_node_wide_pod_pids_limit_caps_forks(cluster, core, kubelet):
    """A pod has no pids field: the kubelet's podPidsLimit is the only cap (node-wide)."""
    ns = cluster.namespace
    kubelet.pod_pids_limit = 32
    core.create_namespaced_pod(ns, pod("p", SLEEPER, securityContext={"runAsUser": 1000}))
    running = wait_phase(core, "p", ns, "Running")
    cid = running.status.container_statuses[0].container_id.removeprefix("docker://")
    assert kubelet.engine.api.inspect_container(cid)["HostConfig"]["PidsLimit"] == 32
    forks = (
        "import os, signal, time\n"
        "kids = []\n"
        "try:\n"
        "    for _ in range(60):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        kids.append(pid)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno)\n"
        "print(len(kids))\n"
        "for kid in kids:\n"
        "    os.kill(kid, signal.SIGKILL)\n"
    )
    out, _, code = run_exec(core, "p", ns, ["python3", "-c", forks])
    assert code == 0
    refused, forked = out.splitlines()
    assert refused == "refused 11"  # EAGAIN
    assert int(forked) < 32

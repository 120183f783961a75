"""The emulator's answers, checked against a real cluster when one is at hand.

Runs only with DEVS_SANDBOX_KUBECONFIG naming a kubeconfig (its current context and that
context's namespace, else ``default``); skipped otherwise, also under
DEVS_SANDBOX_REQUIRE_ALL=1. It uses a Lease (no pod, nothing scheduled) and deletes it.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.kubernetes, pytest.mark.kubernetes_cluster]


@pytest.fixture
def leases() -> Iterator[tuple[Any, str]]:
    from kubernetes import client, config

    path = os.environ["DEVS_SANDBOX_KUBECONFIG"]
    _, active = config.list_kube_config_contexts(path)
    namespace = active["context"].get("namespace", "default")
    with config.new_client_from_config(path) as api:
        yield client.CoordinationV1Api(api), namespace


def test_a_real_server_answers_as_the_emulator_does(leases):
    from kubernetes import client

    api, ns = leases
    name = f"devs-contract-{uuid.uuid4().hex[:8]}"
    lease = api.create_namespaced_lease(ns, {"metadata": {"name": name}})
    try:
        with pytest.raises(client.ApiException) as info:
            api.create_namespaced_lease(ns, {"metadata": {"name": name}})
        assert (info.value.status, json.loads(info.value.body)["message"]) == (
            409,
            f'leases.coordination.k8s.io "{name}" already exists',
        )
        with pytest.raises(client.ApiException) as info:
            api.patch_namespaced_lease(
                name, ns, [{"op": "test", "path": "/spec/holderIdentity", "value": "nobody"}]
            )
        assert info.value.status == 422
        assert json.loads(info.value.body)["message"] == (
            "the server rejected our request due to an error in our request"
        )
        api.patch_namespaced_lease(name, ns, {"spec": {"holderIdentity": "a"}})
        with pytest.raises(client.ApiException) as info:
            api.patch_namespaced_lease(
                name, ns, {"metadata": {"resourceVersion": lease.metadata.resource_version}}
            )
        assert json.loads(info.value.body)["reason"] == "Conflict"
    finally:
        api.delete_namespaced_lease(name, ns)
    with pytest.raises(client.ApiException) as info:
        api.read_namespaced_lease(name, ns)
    assert json.loads(info.value.body)["message"] == (
        f'leases.coordination.k8s.io "{name}" not found'
    )

"""Fixtures for the Kubernetes suite: an emulated cluster, and optionally a real one.

``kubernetes`` tests run against the emulated API server (tests/kubernetes/emulator) on
127.0.0.1, reached through a kubeconfig written for the test, exactly as a driver reaches a
real cluster (``--kubeconfig PATH --context NAME --namespace NS``). Tests that also need pods
to run request ``kubelet`` (and carry the ``docker`` marker): a test kubelet turns the pods
into containers on the local Docker engine and removes them all in teardown.

``kubernetes_cluster`` tests need a real cluster: they run only when
DEVS_SANDBOX_KUBECONFIG names a kubeconfig, and otherwise skip with that reason, even under
DEVS_SANDBOX_REQUIRE_ALL=1 (no CI host has a cluster).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REQUIRE_ALL

CONTEXT = "devs-emulator"
NAMESPACE = "devs-test"
TOKEN = "devs-emulator-token"
KUBECONFIG_ENV = "DEVS_SANDBOX_KUBECONFIG"


def _missing_packages() -> str:
    try:
        import kmock  # noqa: F401

        import kubernetes  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} not installed (pip install -e '.[dev]')"
    return ""


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kubernetes_cluster") is not None:
        path = os.environ.get(KUBECONFIG_ENV, "")
        if not path or not Path(path).is_file():
            pytest.skip(f"no real cluster: {KUBECONFIG_ENV} does not name a kubeconfig file")
    if item.get_closest_marker("kubernetes") is not None:
        reason = _missing_packages()
        if reason and REQUIRE_ALL:
            pytest.fail(f"DEVS_SANDBOX_REQUIRE_ALL=1 but kubernetes unavailable: {reason}")
        if reason:
            pytest.skip(reason)


@dataclass
class EmulatedCluster:
    """What a test gets: the server (for hooks and assertions) and how to reach it."""

    api: Any  # emulator.ApiServer
    url: str
    kubeconfig: Path
    context: str
    namespace: str

    def client(self) -> Any:
        """A new official ApiClient from the kubeconfig file (close it when done)."""
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig), context=self.context)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    """A fresh emulated API server with the test namespace, and its kubeconfig file."""
    from tests.kubernetes.emulator import EmulatorThread, write_kubeconfig

    with EmulatorThread(token=TOKEN, initial_namespaces=("default", NAMESPACE)) as emu:
        path = tmp_path / "kubeconfig"
        write_kubeconfig(str(path), emu.url, context=CONTEXT, namespace=NAMESPACE, token=TOKEN)
        yield EmulatedCluster(emu.api, emu.url, path, CONTEXT, NAMESPACE)
        errors = list(emu.api.internal_errors)
    assert not errors, f"the emulator failed internally: {errors}"


@pytest.fixture
def api_client(cluster: EmulatedCluster) -> Iterator[Any]:
    client = cluster.client()
    yield client
    client.close()


@pytest.fixture
def core(api_client: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(api_client)


@pytest.fixture(scope="session")
def kubelet_image() -> str:
    """The project's offline-built sandbox image (built once per machine and recipe)."""
    from devs_sandbox.engine import connect
    from devs_sandbox.images import ImageRebuilder
    from tests.kubernetes.emulator.kubelet import reap_orphans

    engine = connect()
    try:
        reap_orphans(engine)  # containers of an earlier session that died before teardown
        return ImageRebuilder(engine).ensure().reference
    finally:
        engine.close()


@pytest.fixture
def kubelet(cluster: EmulatedCluster, kubelet_image: str) -> Iterator[Any]:
    """A test kubelet on the local Docker engine; every container it made is removed."""
    from devs_sandbox.engine import connect
    from tests.kubernetes.emulator.kubelet import SESSION_LABEL, Kubelet

    engine = connect()
    client = cluster.client()
    node = Kubelet(
        cluster.api,
        client,
        engine,
        image_map={"*": kubelet_image},
        session=f"t{uuid.uuid4().hex[:10]}",
    ).start()
    try:
        yield node
    finally:
        node.stop()
        left = engine.api.containers(all=True, filters={"label": f"{SESSION_LABEL}={node.session}"})
        with contextlib.suppress(Exception):
            client.close()
        engine.close()
    assert not left, f"the test kubelet left containers: {[c['Id'][:12] for c in left]}"
    assert not node.errors, f"the test kubelet failed: {node.errors}"

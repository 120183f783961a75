"""Shared by the Kubernetes driver's suites: where the sandboxes run (the emulated stack, or
a real cluster named by DEVS_SANDBOX_KUBECONFIG) and a driver factory that leaves nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.config import KubernetesConfig, SandboxLifecycleConfig, override
from devs_sandbox.drivers.kubernetes.driver import KubernetesDriver
from devs_sandbox.drivers.kubernetes.manifest import LABEL_MANAGED, MANAGED_BY
from tests.kubernetes.conftest import KUBECONFIG_ENV

MANAGED = f"{LABEL_MANAGED}={MANAGED_BY}"
WAIT_S = 60.0
REAL_NAMESPACE_ENV = "DEVS_SANDBOX_K8S_NAMESPACE"
REAL_IMAGE_ENV = "DEVS_SANDBOX_K8S_IMAGE"  # needs /bin/sh and python3


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Target:
    """A cluster to run sandboxes in, reached through a kubeconfig as a user would."""

    kubeconfig: Path
    context: str | None
    namespace: str
    emulator: Any = None  # emulator.ApiServer on the emulated stack, else None
    image: str | None = None
    drivers: list[KubernetesDriver] = field(default_factory=list)

    @property
    def emulated(self) -> bool:
        return self.emulator is not None

    def settings(self, **extra: Any) -> dict[str, Any]:
        base: dict[str, Any] = {
            "kubeconfig": self.kubeconfig,
            "context": self.context,
            "namespace": self.namespace,
        }
        if self.image:
            base["image"] = self.image
        return {**base, **extra}

    def config(
        self, kubernetes: dict[str, Any] | None = None, **changes: Any
    ) -> SandboxLifecycleConfig:
        return override(
            SandboxLifecycleConfig(),
            driver="kubernetes",
            kubernetes=self.settings(**(kubernetes or {})),
            **changes,
        )

    def driver(self, **extra: Any) -> KubernetesDriver:
        d = KubernetesDriver(kubernetes=KubernetesConfig(**self.settings(**extra)))
        self.drivers.append(d)
        return d

    def client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig), context=self.context)

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client())

    def objects(self) -> list[str]:
        """Every object of ours left in the namespace (pods, policies, leases)."""
        from kubernetes import client

        api = self.client()
        try:
            core = client.CoreV1Api(api)
            net = client.NetworkingV1Api(api)
            leases = client.CoordinationV1Api(api)
            ns = self.namespace
            found = [
                f"pod/{p.metadata.name}"
                for p in core.list_namespaced_pod(ns, label_selector=MANAGED).items
            ]
            found += [
                f"networkpolicy/{p.metadata.name}"
                for p in net.list_namespaced_network_policy(ns, label_selector=MANAGED).items
            ]
            found += [
                f"lease/{p.metadata.name}"
                for p in leases.list_namespaced_lease(ns, label_selector=MANAGED).items
            ]
            return found
        finally:
            api.close()


def real_target() -> Target:
    path = os.environ.get(KUBECONFIG_ENV, "")
    return Target(
        Path(path),
        None,
        os.environ.get(REAL_NAMESPACE_ENV, "default"),
        image=os.environ.get(REAL_IMAGE_ENV) or None,
    )


def finish(target: Target) -> Iterator[Target]:
    """Yield ``target``; then close every driver, and nothing of ours may be left."""
    yield target
    for d in target.drivers:
        d.close()
    left = wait_for_empty(target)
    assert not left, f"the driver left objects behind: {left}"


def wait_for_empty(target: Target, timeout_s: float = WAIT_S) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = target.objects()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


BOTH = [
    pytest.param("emulated", marks=pytest.mark.docker),
    pytest.param("real", marks=pytest.mark.kubernetes_cluster),
]

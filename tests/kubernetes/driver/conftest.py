"""Fixtures of the Kubernetes driver's suite: where its sandboxes run.

``target`` is parametrized: ``emulated`` (the emulated API server and the test kubelet on
Docker, tests/kubernetes/emulator) and ``real`` (the cluster DEVS_SANDBOX_KUBECONFIG names;
skipped without one, even under DEVS_SANDBOX_REQUIRE_ALL=1). ``emulated`` is the emulated
stack only, for tests that need its fault hooks. Either way every driver a test made is
closed in teardown and the test fails if anything of ours is left in the namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.kubernetes.driver.helpers import Target, finish, real_target


def _emulated(request: pytest.FixtureRequest) -> Target:
    cluster = request.getfixturevalue("cluster")
    request.getfixturevalue("kubelet")
    return Target(cluster.kubeconfig, cluster.context, cluster.namespace, emulator=cluster.api)


@pytest.fixture
def emulated(request: pytest.FixtureRequest) -> Iterator[Target]:
    target = _emulated(request)
    yield from finish(target)


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    kind: Any = request.param
    made = _emulated(request) if kind == "emulated" else real_target()
    yield from finish(made)

"""Fixtures for tests against the real Docker engine.

One image for the session, built through ``ImageRebuilder`` (cached by recipe hash,
so only a fresh machine pays the minute of debootstrap). Every container a test
makes carries this session's label (``devs.test=<session>``) and is removed in
teardown whatever the test did; the session-end leak check in tests/conftest.py
then finds nothing labelled ``devs.managed=true`` that this session owns.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.events import EventBus
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.models import SandboxContext
from tests.helpers import config
from tests.helpers import manager as manager_for

SESSION = f"devs-test-{uuid.uuid4().hex[:10]}"
LABELS = {"devs.test": SESSION}


def dconfig(**changes: Any) -> SandboxLifecycleConfig:
    """``tests.helpers.config`` on the docker driver."""
    return config(driver="docker", **changes)


def session_containers(client: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.api.containers(
        all=True, filters={"label": f"devs.test={SESSION}"}
    )
    return found


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    from devs_sandbox.engine import connect

    client = connect()
    yield client
    for c in session_containers(client):  # a safety net only: tests destroy their own
        with contextlib.suppress(Exception):
            client.api.remove_container(c["Id"], force=True)
    client.close()


BUILT_THIS_SESSION: list[bool] = []  # whether docker_image had to build (a fresh host)


@pytest.fixture(scope="session")
def docker_image(engine: Any) -> str:
    """The default sandbox image, built once per machine and recipe (python3 inside)."""
    from devs_sandbox.images import ImageRebuilder

    built = ImageRebuilder(engine).ensure()
    BUILT_THIS_SESSION.append(not built.cached)
    return built.reference


@pytest.fixture
def bus() -> EventBus:
    return EventBus()


@pytest.fixture
def events(bus: EventBus) -> list[tuple[str, dict[str, Any]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    bus.on(EventBus.WILDCARD, lambda name, payload: seen.append((name, payload)))
    return seen


@pytest.fixture
def driver(docker_image: str, bus: EventBus) -> Iterator[Any]:
    """A Docker driver for this test; whatever it still holds is destroyed afterwards."""
    from devs_sandbox.drivers.docker import DockerDriver

    d = DockerDriver(emit=bus.emit, extra_labels=LABELS)
    yield d
    for ctx in d.live_sandboxes():
        with contextlib.suppress(Exception):
            d.destroy(ctx)
    d.close()


@pytest.fixture
def sandbox(driver: Any) -> Callable[..., SandboxContext]:
    """``sandbox(**config)`` provisions a sandbox that is destroyed in teardown."""

    def make(**changes: Any) -> SandboxContext:
        ctx: SandboxContext = driver.provision(dconfig(**changes))
        return ctx

    return make


@pytest.fixture
def manager(driver: Any, bus: EventBus, tmp_path: Path) -> Iterator[SandboxLifecycleManager]:
    """A lifecycle manager over the test's driver, recording violations in tmp_path."""
    m = manager_for(driver, db=tmp_path / "v.db", bus=bus)
    yield m
    m.shutdown()

"""Backends. The process driver is the embedded default; Docker and Kubernetes are imported
only when asked for (their SDKs are optional extras)."""

from __future__ import annotations

import importlib
from typing import Any

from devs_sandbox.base import SandboxDriver
from devs_sandbox.errors import ConfigError

DRIVER_NAMES = ("process", "docker", "kubernetes", "fake")


def create_driver(name: str, **kwargs: Any) -> SandboxDriver:
    """Instantiate a driver by name; optional backends are imported lazily."""
    if name == "process":
        from devs_sandbox.drivers.process import ProcessDriver  # noqa: PLC0415

        return ProcessDriver(**kwargs)
    if name == "docker":
        # Imported by name: the Docker SDK is an optional dependency.
        module = importlib.import_module("devs_sandbox.drivers.docker")
        driver: SandboxDriver = module.DockerDriver(**kwargs)
        return driver
    if name == "kubernetes":
        # Imported by name: the kubernetes client is an optional dependency, loaded by the
        # driver itself on first use (the manifest builder needs none of it).
        k8s = importlib.import_module("devs_sandbox.drivers.kubernetes.driver")
        kdriver: SandboxDriver = k8s.KubernetesDriver(**kwargs)
        return kdriver
    if name == "fake":
        from devs_sandbox.drivers.fake import FakeDriver  # noqa: PLC0415

        return FakeDriver(**kwargs)
    raise ConfigError(
        f"unknown driver {name!r}; choose one of {', '.join(DRIVER_NAMES)}", key="sandbox.driver"
    )

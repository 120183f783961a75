"""Backends. The process driver is the embedded default; Docker, Kubernetes and Ray are
imported only when asked for (their SDKs are optional extras)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from devs_sandbox.base import Emit, SandboxDriver
from devs_sandbox.errors import ConfigError, DriverUnavailableError

if TYPE_CHECKING:
    from devs_sandbox.config import KubernetesConfig
    from devs_sandbox.security.environment import EnvironmentSanitizer

DRIVER_NAMES = ("process", "docker", "kubernetes", "ray", "fake")
RAY_INSTALL_HINT = "pip install 'devs-sandbox[ray]'"


def create_driver(
    name: str,
    *,
    emit: Emit | None = None,
    sanitizer: EnvironmentSanitizer | None = None,
    host_env: Mapping[str, str] | None = None,
    kubernetes: KubernetesConfig | None = None,
) -> SandboxDriver:
    """Instantiate a driver by name with the services the lifecycle shares with every
    driver: ``emit`` for facts that arrive on their own (an engine's OOM event) and the
    host-environment ``sanitizer``. Optional backends are imported lazily."""
    if name == "process":
        from devs_sandbox.drivers.process import ProcessDriver  # noqa: PLC0415

        return ProcessDriver(emit=emit, sanitizer=sanitizer, host_env=host_env)
    if name == "docker":
        # Imported by name: the Docker SDK is an optional dependency. The engine's own
        # tools get their environment from the sanitizer's wider rule, not this one.
        module = importlib.import_module("devs_sandbox.drivers.docker")
        driver: SandboxDriver = module.DockerDriver(emit=emit)
        return driver
    if name == "kubernetes":
        # Imported by name: the kubernetes client is an optional dependency, loaded by the
        # driver itself on first use (the manifest builder needs none of it).
        k8s = importlib.import_module("devs_sandbox.drivers.kubernetes.driver")
        kdriver: SandboxDriver = k8s.KubernetesDriver(emit=emit, kubernetes=kubernetes)
        return kdriver
    if name == "ray":
        try:
            ray_module = importlib.import_module("devs_sandbox.drivers.ray.driver")
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "ray":
                raise
            raise DriverUnavailableError(
                f"the ray driver needs Ray, which is not installed: {RAY_INSTALL_HINT}"
            ) from None
        ray_driver: SandboxDriver = ray_module.RayDriver(emit=emit)
        return ray_driver
    if name == "fake":
        from devs_sandbox.drivers.fake import FakeDriver  # noqa: PLC0415

        return FakeDriver()
    raise ConfigError(
        f"unknown driver {name!r}; choose one of {', '.join(DRIVER_NAMES)}", key="sandbox.driver"
    )

"""Backends. The process driver is the embedded default; Docker and Ray are imported only
when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from devs_sandbox.base import SandboxDriver
from devs_sandbox.errors import ConfigError, DriverUnavailableError

DRIVER_NAMES = ("process", "docker", "ray", "fake")
RAY_INSTALL_HINT = "pip install 'devs-sandbox[ray]'"


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
    if name == "ray":
        try:
            module = importlib.import_module("devs_sandbox.drivers.ray.driver")
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "ray":
                raise
            raise DriverUnavailableError(
                f"the ray driver needs Ray, which is not installed: {RAY_INSTALL_HINT}"
            ) from None
        ray_driver: SandboxDriver = module.RayDriver(**kwargs)
        return ray_driver
    if name == "fake":
        from devs_sandbox.drivers.fake import FakeDriver  # noqa: PLC0415

        return FakeDriver(**kwargs)
    raise ConfigError(
        f"unknown driver {name!r}; choose one of {', '.join(DRIVER_NAMES)}", key="sandbox.driver"
    )

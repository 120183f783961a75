"""The Kubernetes driver: one hardened pod per sandbox (see ``driver.py``).

Importing this package imports nothing of the ``kubernetes`` client; ``KubernetesDriver``
is loaded on first use, so the manifest builder works without the extra installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devs_sandbox.drivers.kubernetes.driver import KubernetesDriver

__all__ = ["KubernetesDriver"]


def __getattr__(name: str) -> Any:
    if name == "KubernetesDriver":
        from devs_sandbox.drivers.kubernetes.driver import KubernetesDriver  # noqa: PLC0415

        return KubernetesDriver
    raise AttributeError(name)

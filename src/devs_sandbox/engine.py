"""The Docker engine connection: the one place the Docker SDK is imported and its errors mapped.

The SDK is an optional dependency (``pip install 'devs-sandbox[docker]'``), so it
is imported lazily, and a missing SDK or an engine that does not answer become
``DriverUnavailableError`` with the hint to fix it. Every other SDK error is
translated where it enters our code (``engine_errors``), like httpx's
``map_exceptions``: callers of the driver, the image resolver and the exhaustion
handler only ever see the ``errors`` tree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Final

from devs_sandbox.errors import DevsSandboxError, DriverError, DriverUnavailableError
from devs_sandbox.security.environment import tool_environment

if TYPE_CHECKING:
    from docker import DockerClient

INSTALL_HINT: Final = "pip install 'devs-sandbox[docker]'"
ENGINE_TIMEOUT_S: Final = 60.0  # one API call; a remove(force=True) of a wedged container
# may take the engine's own 10 s kill timeout plus overlay teardown, so keep well above


def docker_sdk() -> ModuleType:
    """The ``docker`` module, or ``DriverUnavailableError`` naming the install command."""
    try:
        import docker  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError as exc:
        raise DriverUnavailableError(
            f"the docker driver needs the Docker SDK for Python: {INSTALL_HINT}"
        ) from exc
    return docker


def connect(timeout_s: float = ENGINE_TIMEOUT_S, base_url: str | None = None) -> DockerClient:
    """A client for the engine named by ``base_url`` or the environment (DOCKER_HOST), pinged.

    Ping first, so an engine that is not running fails here with one clear line rather
    than in the middle of a provision.
    """
    docker = docker_sdk()
    try:
        if base_url is None:
            # DOCKER_HOST and friends through the sanitizer's tool profile, never the raw
            # environment (a DOCKER_AUTH_CONFIG or a token has no business in the SDK).
            client: DockerClient = docker.from_env(
                timeout=int(timeout_s), environment=tool_environment()
            )
        else:
            client = docker.DockerClient(base_url=base_url, timeout=int(timeout_s))
        client.ping()
    except docker.errors.DockerException as exc:
        raise DriverUnavailableError(
            f"Docker engine not reachable ({exc}); start dockerd or set DOCKER_HOST"
        ) from exc
    return client


@contextlib.contextmanager
def engine_errors(
    action: str, *, not_found: Callable[[], DevsSandboxError] | None = None
) -> Iterator[None]:
    """Translate SDK and transport errors raised by ``action`` into our tree.

    ``not_found`` builds the error for a 404 (a container or image that is gone);
    without it a 404 is a ``DriverError`` like any other engine failure.
    """
    docker = docker_sdk()
    try:
        yield
    except docker.errors.NotFound as exc:
        if not_found is not None:
            raise not_found() from exc
        raise DriverError(f"{action}: {_explain(exc)}") from exc
    except docker.errors.DockerException as exc:
        raise DriverError(f"{action}: {_explain(exc)}") from exc
    except (OSError, ConnectionError) as exc:
        # requests/urllib3 transport failures (engine restarted, socket gone) surface as
        # OSError subclasses or requests' ConnectionError (an OSError too).
        raise DriverUnavailableError(f"{action}: Docker engine not reachable ({exc})") from exc


def _explain(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)


def is_not_found(exc: BaseException) -> bool:
    """True for the SDK's 404 (used where a missing container is the expected outcome)."""
    docker = docker_sdk()
    return isinstance(exc, docker.errors.NotFound)

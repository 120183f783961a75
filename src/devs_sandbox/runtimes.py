"""Runtime compatibility: does the chosen driver (or its image) provide what a command needs?

A task such as ``cargo build`` or ``npm test`` fails with exit 127 deep inside a
sandbox when the runtime is missing; better to refuse before anything is
created, name the runtime, and suggest the driver that may have it. With
``sandbox.fallbackDriver`` set, the lifecycle instead reruns the choice with that
driver (the process driver falling back to Docker, whose image may carry it).

Which runtime a command needs is read from its first word (through ``sh -c``,
``env`` and leading ``VAR=value`` assignments); a command that names no known
runtime is never gated. What a driver provides comes from the driver itself
(``SandboxDriver.provided_runtimes``): the process driver looks on the sandbox's PATH, the
Docker driver reads the image's ``devs.runtimes`` label. A driver or image that
says nothing is not gated either: unknown is not "missing".
"""

from __future__ import annotations

import re
import shlex
import threading
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Final

from devs_sandbox.base import SandboxDriver
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.errors import UnsupportedRuntimeError
from devs_sandbox.models import ENV_NAME

# Runtime -> commands that need it (regular expressions over the command's basename).
RUNTIME_COMMANDS: Final[dict[str, tuple[str, ...]]] = {
    "python": (r"python[0-9.]*", r"pip[0-9.]*", r"pytest", r"uv", r"poetry"),
    "node": (r"node", r"nodejs", r"npm", r"npx", r"yarn", r"pnpm", r"corepack"),
    "go": (r"go", r"gofmt"),
    "rust": (r"cargo", r"rustc", r"rustup", r"rustfmt"),
}
# Binaries whose presence proves a runtime is installed.
RUNTIME_BINARIES: Final[dict[str, tuple[str, ...]]] = {
    "python": ("python3", "python"),
    "node": ("node", "nodejs"),
    "go": ("go",),
    "rust": ("cargo", "rustc"),
}
FALLBACK_DRIVER: Final = {"process": "docker", "docker": "process"}
_SHELLS: Final = frozenset({"sh", "bash", "dash", "ash", "zsh"})
_ASSIGNMENT = re.compile(rf"^{ENV_NAME.pattern}=")  # a leading VAR=value of a command
_PATTERNS: Final = [
    (runtime, re.compile("|".join(f"(?:{p})" for p in pats)))
    for runtime, pats in RUNTIME_COMMANDS.items()
]


def _first_command(argv: Sequence[str]) -> str | None:
    words = list(argv)
    for _ in range(4):  # sh -c "env FOO=1 exec python3 ..." unwraps in a few steps
        while words and (_ASSIGNMENT.match(words[0]) or words[0] in {"exec", "command"}):
            words = words[1:]
        if not words:
            return None
        head = PurePosixPath(words[0]).name
        if head == "env":
            words = [w for w in words[1:] if not w.startswith("-")]
            continue
        if head in _SHELLS and len(words) >= 3 and words[1] == "-c":
            try:
                words = shlex.split(words[2])
            except ValueError:
                words = words[2].split()
            continue
        return head
    return None


def required_runtime(argv: Sequence[str]) -> str | None:
    """The runtime ``argv`` needs (python, node, go, rust), or None if it names none."""
    head = _first_command(argv)
    if head is None:
        return None
    for runtime, pattern in _PATTERNS:
        if pattern.fullmatch(head):
            return runtime
    return None


class RuntimeCompatibilityChecker:
    """Gates a command by the runtime it needs against what a driver provides (cached)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str | None], frozenset[str] | None] = {}
        self._lock = threading.Lock()

    def provided(
        self, driver: SandboxDriver, config: SandboxLifecycleConfig
    ) -> frozenset[str] | None:
        """Runtimes ``driver`` provides for ``config``; None = it does not say."""
        key = (driver.name, config.image or config.docker.default_image)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        found = driver.provided_runtimes(config)
        with self._lock:
            self._cache[key] = found
        return found

    def check(
        self, driver: SandboxDriver, config: SandboxLifecycleConfig, argv: Sequence[str]
    ) -> str | None:
        """The runtime ``argv`` needs if ``driver`` has it (or None if it needs none);
        ``UnsupportedRuntimeError`` naming the fallback driver if it does not."""
        runtime = required_runtime(argv)
        if runtime is None:
            return None
        provided = self.provided(driver, config)
        if provided is None or runtime in provided:
            return runtime
        suggested = FALLBACK_DRIVER.get(driver.name)
        where = (
            f"image {config.image or 'default'}" if driver.name == "docker" else "this host's PATH"
        )
        hint = (
            f"try --driver {suggested}" + (" with an --image that has it" if suggested else "")
            if suggested
            else "choose a driver that has it"
        )
        if suggested == "docker":
            hint += ', or set sandbox.fallbackDriver to "docker"'
        raise UnsupportedRuntimeError(
            f"{_first_command(argv)} needs the {runtime} runtime, which the {driver.name} "
            f"driver does not provide ({where} has: {', '.join(sorted(provided)) or 'none'}); "
            f"{hint}",
            runtime=runtime,
            suggested_driver=suggested,
        )

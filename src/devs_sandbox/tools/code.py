"""Code by language: a program's text, written into a fresh sandbox and run there.

``run_code(code, "python")`` is ``run_in_sandbox`` of ``python3 main.py`` with ``main.py``
written into the workspace first (through ``Sandbox.write_file``, inside the sandbox).
The runtime gate answers before anything is created when the chosen driver lacks the
language (``UnsupportedRuntimeError`` naming the runtime and the driver that may have it;
with ``sandbox.fallbackDriver`` the run moves there instead).

Before the program runs, ``outputs/`` is made in the workspace, empty (whatever a
``--copy-in`` put there is removed), and its absolute path is in the program's
``$DEVS_SANDBOX_OUTPUT_DIR``. After it ran, also when it failed, the images it left there
(png, jpeg, gif, webp, svg; ``tools.outputs``) come back in the result, checked by content
and bounded; the MCP ``run_code`` tool returns them as image content.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from devs_sandbox.errors import ConfigError, SandboxFileError
from devs_sandbox.tools.outputs import OUTPUT_DIR, OUTPUT_DIR_ENV, OutputImages, collect_images

if TYPE_CHECKING:
    from devs_sandbox.config import SandboxLifecycleConfig
    from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
    from devs_sandbox.models import ExecResult, SandboxOutcome

__all__ = ["LANGUAGES", "OUTPUT_DIR", "CodeResult", "CodeTask", "run_code", "spec_of"]

Language = Literal["python", "node", "bash"]


@dataclass(frozen=True, slots=True)
class LanguageSpec:
    file_name: str
    argv: tuple[str, ...]

    def command(self) -> str:
        """The shell command that runs the program with ``$DEVS_SANDBOX_OUTPUT_DIR`` set
        (through ``sh -c``: the workspace's path inside the sandbox is the shell's
        ``$PWD`` on every driver; the runtime gate reads through ``VAR=... exec``)."""
        return f'{OUTPUT_DIR_ENV}="$PWD/{OUTPUT_DIR}" exec {shlex.join(self.argv)}'


LANGUAGES: Final[dict[str, LanguageSpec]] = {
    "python": LanguageSpec("main.py", ("python3", "main.py")),
    "node": LanguageSpec("main.js", ("node", "main.js")),
    "bash": LanguageSpec("main.sh", ("bash", "main.sh")),
}
# Makes outputs/ empty: "$1" is its name. A link planted in its place is removed, not
# followed (rm -rf does not follow a symlink it is given).
_FRESH_OUTPUTS: Final = 'rm -rf -- "$1" && mkdir -- "$1"'


def spec_of(language: str) -> LanguageSpec:
    try:
        return LANGUAGES[language]
    except KeyError:
        choices = ", ".join(LANGUAGES)
        raise ConfigError(f"language {language!r}: choose {choices}", key="language") from None


def prepare(sandbox: Sandbox, code: str | bytes, language: str) -> None:
    """Write the program into the workspace and make ``outputs/`` there, empty."""
    spec = spec_of(language)
    sandbox.write_file(spec.file_name, code.encode() if isinstance(code, str) else code)
    made = sandbox.exec(("/bin/sh", "-c", _FRESH_OUTPUTS, "devs-sandbox-code", OUTPUT_DIR))
    if made.exit_code != 0:
        detail = made.stderr.text.strip().splitlines()[-1:] or [f"exit {made.exit_code}"]
        raise SandboxFileError(f"{OUTPUT_DIR}: could not be made in the workspace ({detail[0]})")


class CodeTask:
    """The task of a run: write the program, make ``outputs/``, run it; then ``after``
    (copy-outs) when it ran to its own end, and the images it left (``images``) whenever
    the sandbox still runs commands."""

    def __init__(
        self,
        code: str | bytes,
        language: str,
        *,
        after: Callable[[Sandbox, ExecResult], None] | None = None,
        **exec_options: Any,
    ) -> None:
        self.spec = spec_of(language)
        self.code = code
        self.language = language
        self.after = after
        self.exec_options = exec_options
        self.images = OutputImages()

    def __call__(self, sandbox: Sandbox) -> ExecResult:
        prepare(sandbox, self.code, self.language)
        result = sandbox.exec(("/bin/sh", "-c", self.spec.command()), **self.exec_options)
        self.images = collect_images(sandbox)
        ended_itself = not (result.timed_out or result.idle_timed_out or sandbox.violation)
        if self.after is not None and ended_itself:
            self.after(sandbox, result)
        return result


@dataclass(frozen=True, slots=True)
class CodeResult:
    """What ``run_code`` answers: the sandbox's outcome and the images the program left in
    ``outputs/`` (``images.images``; ``images.skipped``: files named as images that were
    not returned, each with its reason)."""

    outcome: SandboxOutcome
    images: OutputImages = field(default_factory=OutputImages)

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code

    @property
    def result(self) -> ExecResult:
        return self.outcome.result


def run_code(
    code: str | bytes,
    language: Language | str,
    config: SandboxLifecycleConfig | None = None,
    *,
    manager: SandboxLifecycleManager | None = None,
    after: Callable[[Sandbox, ExecResult], None] | None = None,
) -> CodeResult:
    """Run ``code`` as a program of ``language`` in a fresh sandbox: the outcome as
    ``run_in_sandbox`` gives it (and raises as it does), with the images it left."""
    from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: PLC0415

    spec = spec_of(language)
    own = manager is None
    mgr = manager or SandboxLifecycleManager()
    try:
        cfg = mgr.config_for(config or mgr.config.sandbox, spec.argv)
        task = CodeTask(code, language, after=after, idle_timeout_s=cfg.idle_timeout_s)
        return CodeResult(mgr.run_in_sandbox(task, cfg), task.images)
    finally:
        if own:
            mgr.shutdown()

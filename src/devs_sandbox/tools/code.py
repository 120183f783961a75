"""Code by language: a program's text, written into a fresh sandbox and run there.

``run_code(code, "python")`` is ``run_in_sandbox`` of ``python3 main.py`` with ``main.py``
written into the workspace first (through ``Sandbox.write_file``, inside the sandbox).
The runtime gate answers before anything is created when the chosen driver lacks the
language (``UnsupportedRuntimeError`` naming the runtime and the driver that may have it;
with ``sandbox.fallbackDriver`` the run moves there instead). Files the program writes
under ``outputs/`` can be copied out, e.g. plots (the MCP ``run_code`` tool returns png and
svg files there as images).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from devs_sandbox.errors import ConfigError

if TYPE_CHECKING:
    from devs_sandbox.config import SandboxLifecycleConfig
    from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
    from devs_sandbox.models import ExecResult, SandboxOutcome

Language = Literal["python", "node", "bash"]
OUTPUT_DIR: Final = "outputs"  # where a program leaves files to hand back (plots)


@dataclass(frozen=True, slots=True)
class LanguageSpec:
    file_name: str
    argv: tuple[str, ...]


LANGUAGES: Final[dict[str, LanguageSpec]] = {
    "python": LanguageSpec("main.py", ("python3", "main.py")),
    "node": LanguageSpec("main.js", ("node", "main.js")),
    "bash": LanguageSpec("main.sh", ("bash", "main.sh")),
}


def spec_of(language: str) -> LanguageSpec:
    try:
        return LANGUAGES[language]
    except KeyError:
        choices = ", ".join(LANGUAGES)
        raise ConfigError(f"language {language!r}: choose {choices}", key="language") from None


def code_task(
    code: str | bytes,
    language: str,
    *,
    after: Callable[[Sandbox, ExecResult], None] | None = None,
    **exec_options: Any,
) -> Callable[[Sandbox], ExecResult]:
    """The task of a run: write the program, make ``outputs/``, run it; then ``after``
    (copy-outs) when it ran to its own end."""
    spec = spec_of(language)
    data = code.encode() if isinstance(code, str) else code

    def task(sandbox: Sandbox) -> ExecResult:
        sandbox.write_file(spec.file_name, data)
        sandbox.write_file(f"{OUTPUT_DIR}/.keep", b"")
        result = sandbox.exec(list(spec.argv), **exec_options)
        ended_itself = not (result.timed_out or result.idle_timed_out or sandbox.violation)
        if after is not None and ended_itself:
            after(sandbox, result)
        return result

    return task


def run_code(
    code: str | bytes,
    language: Language | str,
    config: SandboxLifecycleConfig | None = None,
    *,
    manager: SandboxLifecycleManager | None = None,
    after: Callable[[Sandbox, ExecResult], None] | None = None,
) -> SandboxOutcome:
    """Run ``code`` as a program of ``language`` in a fresh sandbox; the outcome as
    ``run_in_sandbox`` gives it (and raises as it does)."""
    from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: PLC0415

    spec = spec_of(language)
    own = manager is None
    mgr = manager or SandboxLifecycleManager()
    try:
        cfg = mgr.config_for(config or mgr.config.sandbox, spec.argv)
        task = code_task(code, language, after=after, idle_timeout_s=cfg.idle_timeout_s)
        return mgr.run_in_sandbox(task, cfg)
    finally:
        if own:
            mgr.shutdown()

"""``devs-sandbox completion bash|zsh|fish``: the shell's completion script, on stdout.

The script is written from the very parser the command line uses (``build_parser``), so a
new option or subcommand completes without anyone editing a list. shtab writes it for all
three shells (fish since shtab 1.9); it is imported here only, when this command runs, so
no other invocation pays for it. What the parser cannot say, this module adds on a fresh
copy before handing it over: options that name a file or directory complete paths, and the
COMMAND of ``run`` completes as a command.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from devs_sandbox.cli.console import Console
from devs_sandbox.cli.parser import build_parser

_FILE_METAVARS: Final = frozenset({"PATH", "FILE"})
_DIR_METAVARS: Final = frozenset({"DIR"})

# The COMMAND after ``run --``: each shell's own completion of command names. bash calls a
# function (defined in the script's preamble) with the word being completed; zsh and fish
# take an action of their own.
_BASH_COMMANDS: Final = "_devs_sandbox_compgen_commands"
_COMMAND: Final = {
    "bash": _BASH_COMMANDS,
    "zsh": "_command_names -e",
    "fish": "(__fish_complete_command)",
    "preamble": {"bash": f'{_BASH_COMMANDS}() {{ compgen -c -- "$1"; }}'},
}


def parsers(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's parser with its path of subcommand names, the root's first."""
    stack: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = [((), parser)]
    while stack:
        path, current = stack.pop(0)
        yield path, current
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(((*path, name), sub) for name, sub in action.choices.items())


def completion_parser() -> argparse.ArgumentParser:
    """``build_parser()`` with what each argument completes to, in shtab's terms."""
    import shtab  # noqa: PLC0415 - only this command needs it

    parser = build_parser()
    for _path, sub in parsers(parser):
        for action in sub._actions:
            if action.option_strings and action.nargs != 0:
                if action.metavar in _DIR_METAVARS:
                    action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
                elif action.type is Path or action.metavar in _FILE_METAVARS:
                    action.complete = shtab.FILE  # type: ignore[attr-defined]
            elif action.nargs == argparse.REMAINDER:
                action.complete = _COMMAND  # type: ignore[attr-defined]
    # `kubernetes manifest` takes every run option (main.py hands them over unparsed).
    by_path = dict(parsers(parser))
    manifest, run = by_path[("kubernetes", "manifest")], by_path[("run",)]
    taken = {flag for action in manifest._actions for flag in action.option_strings}
    for action in run._actions:
        if action.option_strings and taken.isdisjoint(action.option_strings):
            manifest._add_action(action)
    return parser


def completion_script(shell: str) -> str:
    import shtab  # noqa: PLC0415

    return str(shtab.complete(completion_parser(), shell=shell))


def cmd_completion(args: argparse.Namespace, con: Console) -> int:
    con.out.write(completion_script(args.shell))
    return 0

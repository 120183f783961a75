"""The README's CLI section and the parser behind `--help` say the same thing: every
option of `run` is in the README's table with a line of help in `--help`, nothing in the
table is an option `run` lacks, and every command is named in the README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from devs_sandbox.cli.parser import build_parser
from tests.helpers import run_python

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        o: a
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }


def test_every_run_option_is_in_the_readme_table_and_has_help() -> None:
    run = _subcommands(build_parser())["run"]
    # The first column of the table: the options, in code spans.
    firsts = [
        line.split(" | ")[0] for line in _section("CLI").splitlines() if line.startswith("| `")
    ]
    spans = [span for cell in firsts for span in re.findall(r"`([^`]*)`", cell)]
    documented = {o for span in spans for o in re.findall(r"--[a-z][a-z0-9-]*", span)}
    options = _long_options(run)
    assert sorted(set(options) - documented) == [], "options missing from README's CLI table"
    assert sorted(documented - set(options)) == [], "README names options `run` does not have"
    no_help = [o for o, a in options.items() if not a.help and not o.startswith("--no-")]
    assert no_help == [], "options without a line in --help"


def test_every_command_and_global_option_is_named_in_the_readme() -> None:
    parser = build_parser()
    text = README.read_text()
    for name in _subcommands(parser):
        assert re.search(rf"`(devs-sandbox )?{name}\b", text), f"command {name!r} not in README"
    for option in _long_options(parser):
        assert f"`{option}" in _section("CLI"), f"global option {option} not in README's CLI"


def test_every_option_of_every_command_has_a_line_in_help() -> None:
    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        bare = [f"{path} {o}" for o, a in _long_options(parser).items() if not a.help]
        for name, child in _subcommands(parser).items():
            bare += walk(child, f"{path} {name}")
        return bare

    assert walk(build_parser(), "devs-sandbox") == []


def test_version_is_answered_on_the_fast_path_as_argparse_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from devs_sandbox.cli import fast

    with pytest.raises(SystemExit) as full:
        build_parser().parse_args(["--version"])
    assert full.value.code == 0
    expected = capsys.readouterr().out
    assert fast.main(["--version"]) == 0
    assert capsys.readouterr().out == expected
    # In a process of its own: neither argparse nor the CLI proper is loaded for it.
    probe = (
        "import sys; from devs_sandbox.cli.fast import main; main(['--version']); "
        "print(sorted(m for m in ('argparse', 'devs_sandbox.cli.main') if m in sys.modules))"
    )
    out = run_python(probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [expected.strip(), "[]"]

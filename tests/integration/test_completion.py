"""``devs-sandbox completion SHELL``: each script loaded into the real shell, which is then
asked what it completes (bash through its programmable-completion variables, fish through
``complete -C``, zsh through a pseudo-terminal and its completion widget)."""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devs_sandbox.cli.completion import parsers
from devs_sandbox.cli.parser import build_parser
from tests.conftest import run_cli
from tests.helpers import run_python

pytestmark = pytest.mark.integration
PROG = "devs-sandbox"

# bash: the script's function, called as readline would for LINE with the cursor at its end.
_BASH = r"""
source "$1"
line=$2
read -ra COMP_WORDS <<< "$line"
[[ $line == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMP_LINE=$line
COMP_POINT=${#line}
spec=$(complete -p devs-sandbox) || exit 3
fn=${spec##*-F }
fn=${fn%% *}
"$fn" devs-sandbox "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""

# zsh: an interactive zsh on a pseudo-terminal (zpty) with compinit and the script on $fpath
# as _devs-sandbox (where it is installed). compadd is wrapped to append the matches it is
# given to $__out; each LINE is typed and TAB pressed, then the line is killed. Nothing is
# typed before the line editor is up (typed earlier, the terminal's own line discipline would
# read the TAB and the kill): each step waits for the numbered prompt drawn after it.
_ZSH = r"""
zmodload zsh/zpty || exit 3
fdir=$1 out=$2
shift 2
zpty z TERM=dumb zsh -f -i
zpty -w z "fpath=(${(q)fdir} \$fpath); autoload -U compinit; compinit -u -D"
zpty -w z 'unsetopt auto_list; setopt prompt_subst; __n=0; PS1="READY-\${__n}> "'
zpty -r z log '*READY-0> *' || exit 4
zpty -w z 'compadd() {
  if [[ " ${@[1,(i)(-|--)]} " == *\ -[OAD]*\ * ]]; then builtin compadd "$@"; return; fi
  local -a __hits; builtin compadd -A __hits "$@"
  (( $#__hits )) && print -rl -- $__hits >> $__out
  builtin compadd "$@"
}; __n=x'
zpty -r z log '*READY-x> *' || exit 4
i=0
for line in "$@"; do
  i=$((i+1))
  zpty -w z "__out=${(q)out}/$i; : > \$__out; __n=$i"
  zpty -r z log "*READY-$i> *" || exit 5
  zpty -w -n z "$line"$'\t'
  zpty -w z $'\C-u'"__n=done-$i"
  zpty -r z log "*READY-done-$i> *" || exit 6
done
zpty -d z
"""


def _sh(argv: list[str], cwd: Path) -> str:
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env={**os.environ, "HOME": str(cwd), "XDG_CONFIG_HOME": str(cwd / "xdg")},
    )
    assert r.returncode == 0, (argv, r.stdout, r.stderr)
    return r.stdout


Completer = Callable[[list[str]], list[set[str]]]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scripts from the real command, and a directory to complete paths in."""
    root = tmp_path_factory.mktemp("completion")
    (root / "zfunc").mkdir()
    for shell in ("bash", "zsh", "fish"):
        r = run_cli("completion", shell)
        assert r.returncode == 0 and r.stdout, r.stderr
        (root / f"script.{shell}").write_text(r.stdout)
    # zsh loads it from $fpath as _devs-sandbox, where the --help tells users to put it
    (root / "zfunc" / f"_{PROG}").write_text((root / "script.zsh").read_text())
    (root / "files" / "seed-dir").mkdir(parents=True)
    (root / "files" / "seed-file.json").write_text("{}")
    return root


def _bash(work: Path) -> Completer:
    def complete(lines: list[str]) -> list[set[str]]:
        return [
            set(
                _sh(
                    ["bash", "--norc", "-c", _BASH, "bash", str(work / "script.bash"), line], work
                ).split()
            )
            for line in lines
        ]

    return complete


def _fish(work: Path) -> Completer:
    def complete(lines: list[str]) -> list[set[str]]:
        script = f"source {work / 'script.fish'}\n" + "".join(
            f"complete -C {_fish_quote(line)}; echo '\x1e'\n" for line in lines
        )
        out = _sh(["fish", "--no-config", "-c", script], work)
        chunks = out.split("\x1e\n")[: len(lines)]
        # each candidate is "word<TAB>description"
        return [{row.split("\t")[0] for row in chunk.splitlines() if row} for chunk in chunks]

    return complete


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _zsh(work: Path) -> Completer:
    def complete(lines: list[str]) -> list[set[str]]:
        out = work / "zsh-out"
        out.mkdir(exist_ok=True)
        _sh(["zsh", "-f", "-c", _ZSH, "zsh", str(work / "zfunc"), str(out), *lines], work)
        return [set((out / str(i)).read_text().split()) for i in range(1, len(lines) + 1)]

    return complete


@pytest.fixture(
    params=[
        pytest.param("bash"),
        pytest.param("zsh", marks=pytest.mark.zsh),
        pytest.param("fish", marks=pytest.mark.fish),
    ]
)
def complete(request: pytest.FixtureRequest, work: Path) -> Completer:
    make = {"bash": _bash, "zsh": _zsh, "fish": _fish}[request.param]
    return make(work)


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and action.help != argparse.SUPPRESS
    }


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[set[str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield set(action.choices)


def test_commands_options_and_choices_complete(complete: Completer, work: Path) -> None:
    files = work / "files"
    got = complete(
        [
            f"{PROG} ru",
            f"{PROG} run --ti",
            f"{PROG} config ",
            f"{PROG} run --driver ",
            f"{PROG} kubernetes manifest --mem",  # every run option, as main.py accepts
            f"{PROG} run --config {files}/seed-f",
            f"{PROG} run -- pyth",
        ]
    )
    assert "run" in got[0] and "violations" not in got[0]
    assert got[1] == {"--timeout"}
    assert {"show", "schema"} <= got[2]
    assert {"process", "docker", "kubernetes", "ray"} <= got[3]
    assert "--memory" in got[4]
    assert any(hit.endswith("seed-file.json") for hit in got[5]), got[5]
    assert any(Path(hit).name.startswith("python") for hit in got[6]), got[6]


def test_a_directory_option_completes_directories_only(complete: Completer, work: Path) -> None:
    (hits,) = complete([f"{PROG} run --copy-in {work / 'files'}/seed"])
    assert any("seed-dir" in hit for hit in hits), hits
    assert not any("seed-file" in hit for hit in hits), hits


def test_every_subcommand_and_long_option_of_the_parser_is_offered(complete: Completer) -> None:
    """Walks the parser the CLI runs: an option or subcommand added to it must complete."""
    lines: list[str] = []
    expected: list[set[str]] = []
    for path, sub in parsers(build_parser()):
        words = " ".join((PROG, *path))
        for names in _subcommands(sub):
            lines.append(f"{words} ")
            expected.append(names)
        if path:  # the root's options: --version, --log-level
            lines.append(f"{words} --")
            expected.append(_long_options(sub))
    got = complete(lines)
    assert len(got) == len(lines)
    for line, want, hits in zip(lines, expected, got, strict=True):
        assert want <= hits, (line, sorted(want - hits))


def test_only_the_completion_command_imports_shtab() -> None:
    """shtab costs start-up; `run`, `config` and `--version` never load it."""
    probe = (
        "import sys\n"
        "from devs_sandbox.cli.fast import main\n"
        "statuses = [main(['run', '--', 'true']), main(['config', 'schema'])]\n"
        "before = 'shtab' in sys.modules\n"
        "statuses.append(main(['completion', 'fish']))\n"
        "print(statuses, before, 'shtab' in sys.modules, file=sys.stderr)\n"
    )
    r = run_python(probe)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[-1:] == ["[0, 0, 0] False True"], (r.stdout, r.stderr)


def test_help_says_how_to_install_and_a_bad_shell_is_usage() -> None:
    r = run_cli("completion", "--help")
    assert r.returncode == 0
    for where in (
        "~/.local/share/bash-completion/completions/devs-sandbox",
        "_devs-sandbox",
        "~/.config/fish/completions/devs-sandbox.fish",
    ):
        assert where in r.stdout
    r = run_cli("completion", "tcsh")
    assert r.returncode == 2 and "invalid choice" in r.stderr and len(r.stderr.splitlines()) == 1

"""What a person at a terminal sees: rich tables and the image build's live progress.

Imported by ``violations``, ``doctor`` and ``image build`` only, and only when their stream
is a terminal (rich costs ~50 ms of imports; ``run`` never loads it). On a pipe, or with
``--json``, those commands print what they always have: scripts parse it. rich honours
NO_COLOR (and TERM=dumb) by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from devs_sandbox.cli.commands import progress_line
from devs_sandbox.cli.doctor import mechanism_detail, who


def _console(out: IO[str]) -> Console:
    # Cells carry agent-chosen text (sandbox ids, messages): never read as markup or emoji.
    return Console(file=out, highlight=False, markup=False, emoji=False)


def print_violations(out: IO[str], header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    table = Table(*header, header_style="bold")
    for row in rows:
        table.add_row(*row[:2], Text(row[2], style="red"), *row[3:])
    _console(out).print(table)


def print_doctor(out: IO[str], report: dict[str, Any]) -> None:
    table = Table(
        "mechanism",
        "ok",
        "detail",
        title=f"devs-sandbox doctor (python {report['python']}, euid {report['euid']}, "
        f"sandboxes run as {who(report)})",
        header_style="bold",
    )
    yes, no = Text("yes", style="green"), Text("no", style="bold red")
    for name, info in report["mechanisms"].items():
        if info["available"]:
            table.add_row(name, yes, mechanism_detail(report, name))
        else:
            hint = f"\n-> {info['hint']}" if info["hint"] else ""
            table.add_row(name, no, info["reason"] + hint)
    docker = report["docker"]
    table.add_row(
        "docker", yes if docker["available"] else no, docker.get("version", docker["reason"])
    )
    store = report["store"]
    table.add_row("store", yes if store["writable"] else no, f"{store['path']}")
    console = _console(out)
    console.print(table)
    if report["refused_by_default"]:
        console.print(
            f"-> a default run is refused here ({', '.join(report['refused_by_default'])} "
            "missing) unless --allow-weaker-isolation",
            style="yellow",
        )


class BuildProgress:
    """The image build on a terminal: a spinner, the phase, steps so far and the message on
    one live line; each finished phase stays on the screen as a line of its own."""

    def __init__(self, err: IO[str]) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<11}"),
            TextColumn("{task.fields[steps]}"),
            TextColumn("{task.fields[message]}"),
            TimeElapsedColumn(),
            console=_console(err),
            transient=True,
        )
        self.task = self.progress.add_task("", total=None, steps="", message="")
        self.phase = ""
        self.last = ""  # the line the current phase leaves behind when it ends

    def __enter__(self) -> BuildProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, p: Any) -> None:
        if p.phase != self.phase and self.phase:
            self.progress.console.print(self.last)
        steps = f"{p.packages:>4} steps" if p.packages else ""
        self.progress.update(self.task, description=p.phase, steps=steps, message=p.message)
        self.phase = p.phase
        self.last = progress_line(p)
        if p.phase == "done":
            self.progress.console.print(self.last)

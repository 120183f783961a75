"""The command line's grammar: every option, its type and its help, in one place."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, NoReturn

from devs_sandbox import __version__
from devs_sandbox.cli.console import EXIT_CANNOT_RUN, EXIT_USAGE, PROG, UsageError
from devs_sandbox.config import STRICT_MECHANISMS
from devs_sandbox.errors import ConfigError
from devs_sandbox.models import validate_sandbox_id

_SIZE_SUFFIXES = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting 2, so each subcommand can
    map bad usage to its own documented status (125 for ``run``) with one line."""

    usage_status = EXIT_USAGE

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", self.usage_status)


def parse_size(text: str) -> int:
    """``64m``, ``1g``, ``512k``, ``1024``, ``10MB``, ``1GiB`` -> bytes (binary multiples).

    Not pydantic's ByteSize: it reads ``64m``/``10MB`` as 10**6 multiples, where
    ``docker run -m 64m`` (and so our users) mean MiB."""
    raw = text.strip().lower()
    for tail in ("ib", "b"):
        if raw.endswith(tail) and len(raw) > len(tail):
            raw = raw[: -len(tail)]
            break
    suffix = raw[-1:] if raw[-1:] in _SIZE_SUFFIXES and raw[-1:] != "" else ""
    number = raw[: len(raw) - len(suffix)] if suffix else raw
    invalid = argparse.ArgumentTypeError(
        f"invalid size {text!r} (use e.g. 64m, 1g, 512k or a byte count)"
    )
    try:
        value = float(number)
    except ValueError:
        raise invalid from None
    if not math.isfinite(value) or value * _SIZE_SUFFIXES[suffix] >= 2**63:
        raise invalid  # inf, nan, 1e400: int() would raise OverflowError, not ValueError
    result = int(value * _SIZE_SUFFIXES[suffix])
    if result <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return result


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _cpus(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of cores, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 (no cap) or a positive number, got {text!r}")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return name, value


def _sandbox_id(text: str) -> str:
    try:
        return validate_sandbox_id(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description="Ephemeral, resource-capped sandboxes for agents.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("DEVS_SANDBOX_LOG", "error"),
        choices=["debug", "info", "warning", "error"],
        help="log verbosity on stderr (default: error; env DEVS_SANDBOX_LOG)",
    )
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a command in a fresh sandbox",
        description="Run COMMAND in a fresh sandbox, then destroy it. Use -- before COMMAND.",
    )
    run.usage_status = EXIT_CANNOT_RUN
    run.add_argument(
        "--driver",
        choices=["process", "docker", "kubernetes", "ray"],
        help="backend (default: config)",
    )
    run.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="Ray cluster for --driver ray: HOST:PORT, auto (default) or local",
    )
    run.add_argument("--image", help="container image for --driver docker")
    run.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS", help="total timeout")
    run.add_argument(
        "--idle-timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="kill the run after this long without output",
    )
    run.add_argument("--memory", type=parse_size, metavar="SIZE", help="memory cap (64m, 1g)")
    run.add_argument("--disk", type=parse_size, metavar="SIZE", help="workspace size (tmpfs)")
    run.add_argument(
        "--cpus",
        type=_cpus,
        metavar="N",
        help="CPU cap in cores (default 1; 0 lifts the cap)",
    )
    run.add_argument(
        "--max-processes", type=_positive_int, metavar="N", help="process cap (pids cgroup)"
    )
    run.add_argument("--max-files", type=_positive_int, metavar="N", help="files in the workspace")
    run.add_argument(
        "--max-depth", type=_positive_int, metavar="N", help="directory depth in the workspace"
    )
    run.add_argument(
        "--max-file-size", type=parse_size, metavar="SIZE", help="size of any one file"
    )
    run.add_argument(
        "--max-output",
        type=parse_size,
        metavar="SIZE",
        help="bytes kept of each of stdout and stderr (default 1m)",
    )
    run.add_argument(
        "--poll-interval",
        type=_positive_int,
        metavar="MS",
        help="drain detector interval in milliseconds",
    )
    run.add_argument(
        "--preflight",
        action="append",
        default=[],
        metavar="CMD",
        help="shell command run before the task (repeatable)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        type=_env_pair,
        metavar="KEY=VALUE",
        help="set a variable in the sandbox (repeatable); the host's are not inherited",
    )
    run.add_argument(
        "--network",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow network access (default: no network)",
    )
    run.add_argument("--copy-in", type=Path, metavar="DIR", help="seed the workspace from DIR")
    run.add_argument(
        "--code",
        type=Path,
        metavar="FILE",
        help="run FILE as a program of --language instead of COMMAND",
    )
    run.add_argument(
        "--language",
        choices=["python", "node", "bash"],
        help="the language of --code (python3, node, bash in the sandbox)",
    )
    run.add_argument(
        "--outputs",
        type=Path,
        metavar="DIR",
        help="with --code: save the images the program left in outputs/ (png, jpeg, gif, "
        "webp, svg; checked by content, no symlinks, at most 16 of 2 MiB) into the host "
        "directory DIR",
    )
    run.add_argument(
        "--copy-out",
        type=_copy_out,
        action="append",
        default=[],
        metavar="SRC:DEST",
        help="after the command, copy SRC (a file or directory of the workspace) into the "
        "host directory DEST; no path or symlink out of either, at most 64 MiB (repeatable)",
    )
    run.add_argument(
        "--stdin",
        metavar="FILE",
        help="feed FILE ('-' for this command's stdin) to COMMAND; default /dev/null",
    )
    run.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME[=@FILE]",
        help="deliver a secret as a 0400 file whose path is in NAME_FILE: from FILE, "
        "or from this command's environment variable NAME (repeatable)",
    )
    run.add_argument(
        "--sandbox-id",
        type=_sandbox_id,
        metavar="ID",
        help="a fixed id: letters, digits, ., _, -, at most 64",
    )
    run.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="MECHANISM",
        help="refuse to run without this isolation mechanism (repeatable)",
    )
    run.add_argument(
        "--strict", action="store_true", help=f"require {', '.join(STRICT_MECHANISMS)}"
    )
    run.add_argument(
        "--allow-weaker-isolation",
        action="store_true",
        help="run even where a layer the defaults promise (namespaces, seccomp) is missing; "
        "each missing layer is named on stderr",
    )
    _add_config_option(run)
    _add_db_option(run)
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_cluster_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG...]")

    vio = sub.add_parser("violations", help="list recorded violations")
    _add_db_option(vio)
    _add_config_option(vio)
    vio.add_argument("--sandbox-id", metavar="ID", help="only this sandbox's")
    vio.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N", help="the newest N only"
    )
    vio.add_argument("--json", action="store_true", help="one JSON object on stdout")

    doc = sub.add_parser("doctor", help="show which isolation this host supports, and why not")
    _add_config_option(doc)
    doc.add_argument("--json", action="store_true", help="one JSON object on stdout")

    clean = sub.add_parser("cleanup", help="reap sandboxes left behind by dead processes")
    _add_config_option(clean)
    clean.add_argument("--json", action="store_true", help="one JSON object on stdout")
    clean.add_argument(
        "--driver",
        choices=["process", "docker", "kubernetes"],
        help="only this driver's (default: process and docker, and kubernetes if configured)",
    )
    add_cluster_options(clean)
    _add_kubernetes_parser(sub)

    _add_mcp_parser(sub)

    cfg = sub.add_parser("config", help="show the configuration or its JSON Schema")
    cfg_sub = cfg.add_subparsers(dest="config_cmd", metavar="ACTION", parser_class=_Parser)
    cfg_sub.add_parser("schema", help="print the JSON Schema of devs.config.json")
    show = cfg_sub.add_parser(
        "show",
        help="print the effective configuration and where each value came from",
        description="Every key's effective value and its source: default, /etc/devs-sandbox/"
        "config.json, the user's config, --config / DEVS_SANDBOX_CONFIG, or ./devs.config.json "
        "(which may only tighten).",
    )
    _add_config_option(show)
    show.add_argument("--json", action="store_true", help="{config, sources} as JSON")
    _add_image_parser(sub)
    _add_completion_parser(sub)
    return parser


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="config file (else DEVS_SANDBOX_CONFIG, the user's, the host's)",
    )


def _add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", type=Path, metavar="PATH", help="violation store (SQLite)")


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kubernetes (--driver kubernetes)")
    group.add_argument("--kubeconfig", type=Path, metavar="PATH", help="kubeconfig file")
    group.add_argument("--context", metavar="NAME", help="kubeconfig context")
    group.add_argument("--namespace", metavar="NS", help="namespace of the sandboxes' pods")


def cluster_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The ``sandbox.kubernetes`` keys given on the command line."""
    picked = {
        "kubeconfig": getattr(args, "kubeconfig", None),
        "context": getattr(args, "context", None),
        "namespace": getattr(args, "namespace", None),
    }
    return {k: v for k, v in picked.items() if v is not None}


def _add_kubernetes_parser(sub: Any) -> None:
    k8s = sub.add_parser("kubernetes", help="the kubernetes driver's objects")
    k8s_sub = k8s.add_subparsers(dest="k8s_cmd", metavar="ACTION", parser_class=_Parser)
    man = k8s_sub.add_parser(
        "manifest",
        help="print the Pod and NetworkPolicy a run would create, without a cluster",
        description="Print the objects `devs-sandbox run --driver kubernetes [run options]` "
        "would create (like kubectl create --dry-run=client). Accepts every run option.",
    )
    man.add_argument(
        "--output", choices=["json", "yaml"], default="yaml", help="format (default: yaml)"
    )
    man.add_argument(
        "--server-version",
        default="1.28",
        metavar="MAJOR.MINOR",
        help="the API server to write for: newer fields only for a server that has them",
    )


def _add_mcp_parser(sub: Any) -> None:
    mcp = sub.add_parser(
        "mcp",
        help="serve the sandbox to agents over the Model Context Protocol",
        description="Serve the run_shell_monitored and sandbox_* tools over stdio (default) "
        "or streamable HTTP. Every sandbox is destroyed when the server stops. Over HTTP each "
        "MCP session is a tenant: its sandboxes and violations are its own, and die with it.",
    )
    mcp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    mcp.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP address to bind (default: 127.0.0.1); any but loopback needs --auth-token-file",
    )
    mcp.add_argument("--port", type=_port, default=8000, help="HTTP port (default: 8000)")
    mcp.add_argument(
        "--auth-token-file",
        type=Path,
        metavar="PATH",
        help="HTTP: require 'Authorization: Bearer TOKEN' on every request, TOKEN being this "
        "file's one line (mode 600, read once at start)",
    )
    _add_config_option(mcp)
    _add_db_option(mcp)


def _copy_out(text: str) -> tuple[str, str]:
    src, sep, dest = text.partition(":")
    if not sep or not src or not dest:
        raise argparse.ArgumentTypeError(f"expected SRC:DEST, got {text!r}")
    return src, dest


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65_535:
        raise argparse.ArgumentTypeError(f"port must be between 1 and 65535, got {value}")
    return value


def _add_image_parser(sub: Any) -> None:
    img = sub.add_parser("image", help="the docker driver's default sandbox image")
    img_sub = img.add_subparsers(dest="image_cmd", metavar="ACTION", parser_class=_Parser)
    build = img_sub.add_parser(
        "build",
        help="build the default image without a registry (debootstrap; root; cached)",
        description="Build the default sandbox image from the recipe shipped with devs-sandbox "
        "(Debian minbase with python3), offline, and cache it: a second build is instant.",
    )
    build.add_argument("--tag", metavar="NAME[:TAG]", help="also tag the image as NAME[:TAG]")
    build.add_argument("--force", action="store_true", help="rebuild even if it is cached")
    build.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _add_completion_parser(sub: Any) -> None:
    shells = ("bash", "zsh", "fish")
    comp = sub.add_parser(
        "completion",
        help="print the shell completion script for bash, zsh or fish",
        description="Print the completion script of SHELL on stdout, written from this very "
        "command line: every subcommand, option and choice, paths for options that take one.",
        epilog="install it where the shell looks for completions:\n"
        f"  bash  {PROG} completion bash > ~/.local/share/bash-completion/completions/{PROG}\n"
        f"  zsh   {PROG} completion zsh > DIR/_{PROG}   (DIR on $fpath, before compinit)\n"
        f"  fish  {PROG} completion fish > ~/.config/fish/completions/{PROG}.fish\n"
        f"or load it into the running shell: source <({PROG} completion bash)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    comp.add_argument("shell", choices=shells, metavar="SHELL", help=" or ".join(shells))

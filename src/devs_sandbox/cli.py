"""The ``devs-sandbox`` command: a thin shell over the library API.

Exit status of ``run`` follows timeout(1): the command's own status; 124 when
the total (or idle) timeout fired; 137 when the sandbox was killed for a quota
violation; 125 when the sandbox could not run (bad option or config, missing
required isolation, preflight failure, driver failure). Other subcommands exit
0, 1 on a devs-sandbox error, 2 on bad usage. Every error is one line on stderr;
no traceback reaches a user unless ``--log-level debug`` asks for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final, NoReturn

from devs_sandbox import __version__
from devs_sandbox.config import (
    STRICT_MECHANISMS,
    DevsConfig,
    SandboxLifecycleConfig,
    default_db_path,
    load_config,
    override,
    render_schema,
)
from devs_sandbox.errors import (
    ConfigError,
    DevsSandboxError,
    QuotaExceededError,
    SandboxCancelledError,
    SandboxPreFlightError,
    SandboxTimeoutError,
    SecretError,
)
from devs_sandbox.models import SandboxOutcome, validate_sandbox_id

PROG: Final = "devs-sandbox"
EXIT_TIMEOUT: Final = 124
EXIT_CANNOT_RUN: Final = 125
EXIT_KILLED: Final = 137
EXIT_INTERRUPTED: Final = 130
EXIT_USAGE: Final = 2
EXIT_ERROR: Final = 1
_SIZE_SUFFIXES: Final = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

logger = logging.getLogger("devs_sandbox.cli")


class UsageError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting 2, so each subcommand can
    map bad usage to its own documented status (125 for ``run``) with one line."""

    usage_status = EXIT_USAGE

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", self.usage_status)


def parse_size(text: str) -> int:
    """``64m``, ``1g``, ``512k``, ``1024``, ``10MB``, ``1GiB`` -> bytes (binary multiples)."""
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
    run.add_argument("--driver", choices=["process", "docker"], help="backend (default: config)")
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
    run.add_argument("--cpus", type=float, metavar="N", help="CPU cap in cores")
    run.add_argument("--max-processes", type=_positive_int, metavar="N")
    run.add_argument("--max-files", type=_positive_int, metavar="N")
    run.add_argument("--max-depth", type=_positive_int, metavar="N")
    run.add_argument("--max-file-size", type=parse_size, metavar="SIZE")
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
    run.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE")
    run.add_argument(
        "--network",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow network access (default: no network)",
    )
    run.add_argument("--copy-in", type=Path, metavar="DIR", help="seed the workspace from DIR")
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
    run.add_argument("--sandbox-id", type=_sandbox_id, metavar="ID")
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
    run.add_argument("--config", type=Path, metavar="PATH")
    run.add_argument("--db", type=Path, metavar="PATH", help="violation store (SQLite)")
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG...]")

    vio = sub.add_parser("violations", help="list recorded violations")
    vio.add_argument("--db", type=Path, metavar="PATH")
    vio.add_argument("--config", type=Path, metavar="PATH")
    vio.add_argument("--sandbox-id", metavar="ID")
    vio.add_argument("--limit", type=_positive_int, default=None, metavar="N")
    vio.add_argument("--json", action="store_true")

    doc = sub.add_parser("doctor", help="show which isolation this host supports, and why not")
    doc.add_argument("--config", type=Path, metavar="PATH")
    doc.add_argument("--json", action="store_true")

    clean = sub.add_parser("cleanup", help="reap sandboxes left behind by dead processes")
    clean.add_argument("--config", type=Path, metavar="PATH")
    clean.add_argument("--json", action="store_true")

    _add_mcp_parser(sub)

    cfg = sub.add_parser("config", help="show the configuration or its JSON Schema")
    cfg_sub = cfg.add_subparsers(dest="config_cmd", metavar="ACTION", parser_class=_Parser)
    cfg_sub.add_parser("schema", help="print the JSON Schema of devs.config.json")
    show = cfg_sub.add_parser("show", help="print the effective configuration")
    show.add_argument("--config", type=Path, metavar="PATH")
    _add_image_parser(sub)
    return parser


# -- run -------------------------------------------------------------------------------
def _run_config(args: argparse.Namespace, file_cfg: DevsConfig) -> SandboxLifecycleConfig:
    changes: dict[str, Any] = {}
    quotas: dict[str, Any] = {}
    isolation: dict[str, Any] = {}
    if args.driver:
        changes["driver"] = args.driver
    if args.image:
        changes["image"] = args.image
    if args.timeout is not None:
        changes["timeout_ms"] = max(1, round(args.timeout * 1000))
    if args.idle_timeout is not None:
        changes["idle_timeout_ms"] = max(1, round(args.idle_timeout * 1000))
    if args.preflight:
        changes["preflight_commands"] = tuple(args.preflight)
    if args.env:
        changes["env"] = {**file_cfg.sandbox.env, **dict(args.env)}
    if args.network is not None:
        changes["network"] = args.network
    if args.copy_in is not None:
        changes["copy_in"] = args.copy_in
    if args.sandbox_id:
        changes["sandbox_id"] = args.sandbox_id
    if args.max_output is not None:
        changes["max_output_bytes"] = args.max_output
    for opt, key in (
        ("memory", "memory_bytes"),
        ("disk", "disk_bytes"),
        ("cpus", "cpu_cores"),
        ("max_processes", "process_count_limit"),
        ("max_files", "file_count_limit"),
        ("max_depth", "directory_depth_limit"),
        ("max_file_size", "max_file_size_bytes"),
        ("poll_interval", "poll_interval_ms"),
    ):
        value = getattr(args, opt)
        if value is not None:
            quotas[key] = value
    required = list(file_cfg.sandbox.isolation.required)
    if args.strict:
        required += list(STRICT_MECHANISMS)
    required += args.require
    if required != list(file_cfg.sandbox.isolation.required):
        isolation["required"] = tuple(dict.fromkeys(required))
    if quotas:
        changes["quotas"] = quotas
    if isolation:
        changes["isolation"] = isolation
    return override(file_cfg.sandbox, **changes)


def _db_path(args: argparse.Namespace, file_cfg: DevsConfig) -> Path:
    if getattr(args, "db", None):
        return Path(args.db)
    if os.environ.get("DEVS_SANDBOX_DB"):
        return default_db_path()
    return file_cfg.store.path or default_db_path()


class _Stream:
    """Forward a sandbox stream to ours as it comes; stop quietly if our reader went away."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.broken = False

    def __call__(self, chunk: bytes) -> None:
        if self.broken:
            return
        try:
            self.target.write(chunk)
            self.target.flush()
        except (BrokenPipeError, ValueError, OSError):
            self.broken = True


def _read_secrets(specs: Sequence[str]) -> dict[str, bytes]:
    """``NAME=@FILE`` reads FILE; ``NAME`` reads our own environment variable NAME. The
    values never appear on a command line: only the names and paths do."""
    from devs_sandbox.security.session_keys import validate_secret_name  # noqa: PLC0415

    out: dict[str, bytes] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        validate_secret_name(name)
        if sep:
            if not source.startswith("@") or len(source) < 2:
                raise SecretError(
                    f"--secret {name}: give the value as NAME=@FILE or NAME (from the "
                    "environment), never inline on the command line"
                )
            try:
                out[name] = Path(source[1:]).read_bytes()
            except OSError as exc:
                raise SecretError(
                    f"--secret {name}: cannot read {source[1:]}: {exc.strerror}"
                ) from None
        else:
            value = os.environ.get(name)
            if value is None:
                raise SecretError(f"--secret {name}: not set in the environment")
            out[name] = value.encode()
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: PLC0415
    from devs_sandbox.store import ViolationStore  # noqa: PLC0415

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError(
            f"{PROG} run: missing COMMAND (usage: {PROG} run [OPTIONS] -- COMMAND)", EXIT_CANNOT_RUN
        )
    file_cfg = load_config(args.config)
    cfg = _run_config(args, file_cfg)
    secrets = _read_secrets(args.secret)
    store = ViolationStore(_db_path(args, file_cfg))
    manager = SandboxLifecycleManager(config=file_cfg, store=store)
    streams: dict[str, Any] = {}
    if not args.json:
        streams = {
            "on_stdout": _Stream(sys.stdout.buffer),
            "on_stderr": _Stream(sys.stderr.buffer),
        }
    stdin_data: bytes | None = None
    if args.stdin == "-":
        stdin_data = sys.stdin.buffer.read()
    elif args.stdin:
        try:
            stdin_data = Path(args.stdin).read_bytes()
        except OSError as exc:
            raise UsageError(
                f"{PROG} run: --stdin {args.stdin}: {exc.strerror}", EXIT_CANNOT_RUN
            ) from None
    outcome: SandboxOutcome | None = None
    status = 0
    error_line: str | None = None
    try:
        outcome = manager.run_in_sandbox(command, cfg, stdin=stdin_data, secrets=secrets, **streams)
        status = outcome.exit_code
    except SandboxTimeoutError as exc:
        outcome, status, error_line = exc.outcome, EXIT_TIMEOUT, str(exc)
    except QuotaExceededError as exc:
        outcome, status, error_line = exc.outcome, EXIT_KILLED, str(exc)
    except SandboxCancelledError as exc:
        outcome, status, error_line = exc.outcome, EXIT_INTERRUPTED, str(exc)
    except SandboxPreFlightError as exc:
        status, error_line = EXIT_CANNOT_RUN, str(exc)
        if exc.result is not None and not args.json:
            tail = exc.result.stderr.text.strip().splitlines()[-1:]
            if tail:
                error_line += f" ({tail[0]})"
    finally:
        manager.shutdown()
    if args.json:
        if outcome is not None:
            payload = outcome.to_json()
            payload["exit_code"] = status
        else:
            payload = {"exit_code": status, "error": error_line}
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    if error_line:
        print(f"{PROG}: {error_line}", file=sys.stderr)
    return status


# -- other commands -----------------------------------------------------------------------
def cmd_violations(args: argparse.Namespace) -> int:
    from devs_sandbox.store import ViolationStore  # noqa: PLC0415

    file_cfg = load_config(args.config)
    with ViolationStore(_db_path(args, file_cfg)) as store:
        rows = store.list(sandbox_id=args.sandbox_id, limit=args.limit)
    if args.json:
        json.dump(rows, sys.stdout, indent=None)
        sys.stdout.write("\n")
        return 0
    if not rows:
        print("no violations recorded")
        return 0
    header = ("terminated_at", "sandbox_id", "violation_type", "observed", "limit", "rule")
    table = [header] + [
        (
            r["terminated_at"],
            r["sandbox_id"],
            r["violation_type"],
            str(r["observed_value"]),
            str(r["limit_value"]),
            r["rule"],
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from devs_sandbox.doctor import diagnose, render  # noqa: PLC0415

    file_cfg = load_config(args.config)
    report = diagnose(file_cfg)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report))
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from devs_sandbox.doctor import cleanup_all  # noqa: PLC0415

    file_cfg = load_config(args.config)
    reaped = cleanup_all(file_cfg)
    if args.json:
        json.dump({"reaped": reaped}, sys.stdout)
        sys.stdout.write("\n")
    elif reaped:
        for driver, ids in reaped.items():
            for sandbox_id in ids:
                print(f"reaped {driver} sandbox {sandbox_id}")
    else:
        print("nothing to clean up")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.config_cmd == "schema":
        sys.stdout.write(render_schema())
        return 0
    if args.config_cmd == "show":
        cfg = load_config(args.config)
        json.dump(cfg.model_dump(mode="json", by_alias=True), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    raise UsageError(f"{PROG} config: choose 'schema' or 'show'", EXIT_USAGE)


# -- mcp ----------------------------------------------------------------------------------
MCP_INSTALL_HINT: Final = "pip install 'devs-sandbox[mcp]'"


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
    mcp.add_argument("--config", type=Path, metavar="PATH")
    mcp.add_argument("--db", type=Path, metavar="PATH", help="violation store (SQLite)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65_535:
        raise argparse.ArgumentTypeError(f"port must be between 1 and 65535, got {value}")
    return value


def cmd_mcp(args: argparse.Namespace) -> int:
    try:
        from devs_sandbox import mcp_server  # noqa: PLC0415 - the SDK is an optional extra
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in {"mcp", "mcp_types"}:
            raise
        raise DevsSandboxError(
            f"the MCP server needs the MCP SDK, which is not installed: {MCP_INSTALL_HINT}"
        ) from None
    if args.auth_token_file is not None and not args.http:
        raise UsageError(f"{PROG} mcp: --auth-token-file needs --http", EXIT_USAGE)
    file_cfg = load_config(args.config)
    token = None
    if args.http and args.auth_token_file is not None:
        try:
            token = mcp_server.read_auth_token(args.auth_token_file)
        except ConfigError as exc:
            raise UsageError(f"{PROG} mcp: {exc}", EXIT_CANNOT_RUN) from None
    if args.http and token is None and not mcp_server.is_loopback(args.host):
        raise UsageError(
            f"{PROG} mcp: refusing to listen on {args.host} without --auth-token-file: anyone "
            "who can reach it could run commands on this host",
            EXIT_CANNOT_RUN,
        )
    if token is not None and not mcp_server.is_loopback(args.host):
        print(
            f"{PROG} mcp: WARNING: plain HTTP on {args.host} carries the token and every "
            "command in clear text; put a TLS proxy in front of it",
            file=sys.stderr,
        )
    return mcp_server.serve(
        file_cfg,
        db_path=_db_path(args, file_cfg),
        http=args.http,
        host=args.host,
        port=args.port,
        auth_token=token,
    )


# -- image ---------------------------------------------------------------------------------
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


class _BuildProgress:
    """One line per phase on a pipe; one line rewritten in place on a terminal."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.phase = ""
        self.shown = 0

    def __call__(self, p: Any) -> None:
        line = f"[{p.elapsed_s:6.1f}s] {p.phase:<11}"
        if p.packages:
            line += f" {p.packages:>4} steps"
        line += f"  {p.message}"
        if self.tty:
            end = "\n" if p.phase != self.phase and self.phase else ""
            self.out.write(f"{end}\r{line[:110]:<110}")
            if p.phase == "done":
                self.out.write("\n")
        elif p.phase != self.phase or p.packages - self.shown >= 50:
            self.out.write(line + "\n")
            self.shown = p.packages
        self.phase = p.phase
        self.out.flush()


def cmd_image(args: argparse.Namespace) -> int:
    if args.image_cmd != "build":
        raise UsageError(f"{PROG} image: choose 'build'", EXIT_USAGE)
    from devs_sandbox.engine import connect, docker_sdk  # noqa: PLC0415
    from devs_sandbox.images import ImageRebuilder  # noqa: PLC0415

    client = connect()
    rebuilder = ImageRebuilder(client)
    progress = None if args.json else _BuildProgress(sys.stderr)
    built = (
        rebuilder.build(on_progress=progress)
        if args.force
        else rebuilder.ensure(on_progress=progress)
    )
    payload = built.to_json()
    if args.tag:
        repository, tag = docker_sdk().utils.parse_repository_tag(args.tag)
        client.images.get(built.reference).tag(repository, tag or "latest")
        payload["tag"] = f"{repository}:{tag or 'latest'}"
    client.close()
    if args.json:
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
    else:
        how = "cached" if built.cached else f"built in {built.build_s:.1f} s"
        size = f", {built.size_bytes / 2**20:.0f} MiB" if built.size_bytes else ""
        print(f"{built.reference} ({built.image_id[:19]}{size}): {how}")
        if args.tag:
            print(f"tagged {payload['tag']}")
    return 0


COMMANDS = {
    "run": cmd_run,
    "violations": cmd_violations,
    "doctor": cmd_doctor,
    "cleanup": cmd_cleanup,
    "config": cmd_config,
    "mcp": cmd_mcp,
    "image": cmd_image,
}


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # Unwind through every ``finally`` so the sandbox is destroyed, then exit 128 + N.
    raise SystemExit(128 + signum)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("devs_sandbox")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(args_list)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return exc.status
    if extra:
        status = EXIT_CANNOT_RUN if args.cmd == "run" else EXIT_USAGE
        where = f"{PROG} {args.cmd}" if args.cmd else PROG
        print(f"{where}: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return status
    _setup_logging(args.log_level)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.cmd == "config" and args.config_cmd is None:
        print(f"{PROG} config: choose 'schema' or 'show'", file=sys.stderr)
        return EXIT_USAGE
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    failure_status = EXIT_CANNOT_RUN if args.cmd == "run" else EXIT_ERROR
    try:
        return COMMANDS[args.cmd](args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return exc.status
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN if args.cmd == "run" else EXIT_USAGE
    except DevsSandboxError as exc:
        logger.debug("failure", exc_info=True)
        print(f"{PROG}: {exc}", file=sys.stderr)
        return failure_status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; sandbox destroyed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        # A bug of ours, not bad input: still one line, the traceback only on request.
        logger.debug("internal error", exc_info=True)
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {exc} "
            "(rerun with --log-level debug for details)",
            file=sys.stderr,
        )
        return failure_status
    finally:
        signal.signal(signal.SIGTERM, previous)

"""``devs-sandbox run``: one command in a fresh sandbox, with timeout(1)'s exit statuses."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from devs_sandbox.cli.console import (
    EXIT_CANNOT_RUN,
    EXIT_INTERRUPTED,
    EXIT_KILLED,
    EXIT_TIMEOUT,
    PROG,
    Console,
    RunInCaller,
    UsageError,
)
from devs_sandbox.cli.parser import cluster_changes
from devs_sandbox.config import (
    STRICT_MECHANISMS,
    DevsConfig,
    SandboxLifecycleConfig,
    default_db_path,
    ms_from_s,
    override,
)
from devs_sandbox.errors import (
    ConfigError,
    QuotaExceededError,
    SandboxCancelledError,
    SandboxLostError,
    SandboxPreFlightError,
    SandboxTimeoutError,
    SecretError,
)
from devs_sandbox.events import SandboxEvents
from devs_sandbox.models import ExecResult, SandboxOutcome
from devs_sandbox.tools.code import CodeTask, spec_of

if TYPE_CHECKING:
    from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager


# Drivers whose client belongs to the calling process (Ray: one connection per process,
# ray.init/ray.shutdown): never run by the local server for its clients.
CALLER_PROCESS_DRIVERS: Final = frozenset({"ray"})


def load_file_config(args: argparse.Namespace, con: Console) -> DevsConfig:
    """The effective configuration for this invocation: its working directory, its
    environment, its ``--config``."""
    from devs_sandbox.config_trust import load_layered_config  # noqa: PLC0415

    explicit = con.path(args.config) if getattr(args, "config", None) else None
    return load_layered_config(explicit, cwd=con.cwd, env=con.env).config


def run_config(
    args: argparse.Namespace, file_cfg: DevsConfig, con: Console
) -> SandboxLifecycleConfig:
    changes: dict[str, Any] = {}
    quotas: dict[str, Any] = {}
    isolation: dict[str, Any] = {}
    if args.driver:
        changes["driver"] = args.driver
    if args.image:
        changes["image"] = args.image
    if args.ray_address:
        changes["ray"] = {"address": args.ray_address}
    if args.timeout is not None:
        changes["timeout_ms"] = ms_from_s(args.timeout)
    if args.idle_timeout is not None:
        changes["idle_timeout_ms"] = ms_from_s(args.idle_timeout)
    if args.preflight:
        changes["preflight_commands"] = tuple(args.preflight)
    if args.env:
        changes["env"] = {**file_cfg.sandbox.env, **dict(args.env)}
    if args.network is not None:
        changes["network"] = args.network
    if args.copy_in is not None:
        changes["copy_in"] = con.path(args.copy_in)
    if args.sandbox_id:
        changes["sandbox_id"] = args.sandbox_id
    if args.max_output is not None:
        changes["max_output_bytes"] = args.max_output
    for opt, key in (
        ("memory", "memory_bytes"),
        ("disk", "disk_bytes"),
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
    if args.cpus is not None:
        quotas["cpu_cores"] = args.cpus or None  # 0: no cap
    if args.allow_weaker_isolation:
        isolation["allow_weaker_isolation"] = True
    if quotas:
        changes["quotas"] = quotas
    if isolation:
        changes["isolation"] = isolation
    if cluster_changes(args):
        changes["kubernetes"] = cluster_changes(args)
    try:
        return override(file_cfg.sandbox, **changes)
    except ConfigError as exc:
        option = _option_error(args, exc)
        if option is None:
            raise
        raise UsageError(option, EXIT_CANNOT_RUN) from None


# The run options that set a bounded config key: (option, attribute, unit, config units per
# option unit). A bound the config refuses is said in the option's terms, not the key's.
_OPTION_OF_KEY: Final = {
    "sandbox.timeoutMs": ("--timeout", "timeout", "seconds", 1000),
    "sandbox.idleTimeoutMs": ("--idle-timeout", "idle_timeout", "seconds", 1000),
    "sandbox.maxOutputBytes": ("--max-output", "max_output", "bytes", 1),
    "sandbox.quotas.memoryBytes": ("--memory", "memory", "bytes", 1),
    "sandbox.quotas.diskBytes": ("--disk", "disk", "bytes", 1),
    "sandbox.quotas.processCountLimit": ("--max-processes", "max_processes", "", 1),
    "sandbox.quotas.fileCountLimit": ("--max-files", "max_files", "", 1),
    "sandbox.quotas.directoryDepthLimit": ("--max-depth", "max_depth", "", 1),
    "sandbox.quotas.maxFileSizeBytes": ("--max-file-size", "max_file_size", "bytes", 1),
    "sandbox.quotas.pollIntervalMs": ("--poll-interval", "poll_interval", "milliseconds", 1),
    "sandbox.quotas.cpuCores": ("--cpus", "cpus", "cores", 1),
}
_BOUND: Final = re.compile(r"(less|greater) than or equal to (-?[0-9.e+]+)")


def _option_error(args: argparse.Namespace, exc: ConfigError) -> str | None:
    """``--timeout 100000: at most 86400 seconds`` for a bound the config refused on a key
    that an option of this run set; None when the key was not set by an option."""
    known = _OPTION_OF_KEY.get(exc.key or "")
    if known is None:
        return None
    option, attr, unit, per = known
    given = getattr(args, attr, None)
    if given is None:
        return None
    bound = _BOUND.search(str(exc))
    if bound is None:
        why = str(exc).split(": ", 1)[-1]
    else:
        limit = float(bound.group(2)) / per
        word = "at most" if bound.group(1) == "less" else "at least"
        amount = str(int(limit)) if limit.is_integer() else f"{limit:g}"
        why = f"must be {word} {amount}{' ' + unit if unit else ''}"
    shown = f"{given:g}" if isinstance(given, float) else str(given)
    return f"{PROG} run: {option} {shown}: {why}"


def db_path(args: argparse.Namespace, file_cfg: DevsConfig, con: Console) -> Path:
    if getattr(args, "db", None):
        return con.path(args.db)
    if con.env.get("DEVS_SANDBOX_DB"):
        return default_db_path(con.env)
    return file_cfg.store.path or default_db_path(con.env)


class _Canceller:
    """Cancels the run's sandbox when the invocation is interrupted (the server's client
    was), also if that happens before the sandbox exists: it is cancelled as it appears."""

    def __init__(self, manager: SandboxLifecycleManager) -> None:
        self.manager = manager
        self.ids: list[str] = []
        self.cancelled = False
        self.lock = threading.Lock()

    def created(self, _name: str, event: dict[str, Any]) -> None:
        with self.lock:
            self.ids.append(event["sandbox_id"])
            cancel = self.cancelled
        if cancel:
            self.manager.cancel(event["sandbox_id"])

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            ids = list(self.ids)
        for sandbox_id in ids:
            self.manager.cancel(sandbox_id)


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


def _read_secrets(specs: Sequence[str], con: Console) -> dict[str, bytes]:
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
                out[name] = con.path(source[1:]).read_bytes()
            except OSError as exc:
                raise SecretError(
                    f"--secret {name}: cannot read {source[1:]}: {exc.strerror}"
                ) from None
        else:
            value = con.env.get(name)
            if value is None:
                raise SecretError(f"--secret {name}: not set in the environment")
            out[name] = value.encode()
    return out


def cmd_run(args: argparse.Namespace, con: Console) -> int:
    from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: PLC0415
    from devs_sandbox.store import ViolationStore  # noqa: PLC0415

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    code: bytes | None = None
    if args.code is not None or args.language is not None:
        code = _read_code(args, command, con)
        command = list(spec_of(args.language).argv)
    elif args.outputs is not None:
        raise UsageError(f"{PROG} run: --outputs DIR goes with --code", EXIT_CANNOT_RUN)
    if not command:
        raise UsageError(
            f"{PROG} run: missing COMMAND (usage: {PROG} run [OPTIONS] -- COMMAND)", EXIT_CANNOT_RUN
        )
    file_cfg = load_file_config(args, con)
    cfg = run_config(args, file_cfg, con)
    if cfg.driver in CALLER_PROCESS_DRIVERS and not con.in_process:
        # Picked by a configuration file (the fast path sees only --driver ray).
        raise RunInCaller(f"the {cfg.driver} driver runs in the calling process")
    secrets = _read_secrets(args.secret, con)
    store = ViolationStore(db_path(args, file_cfg, con))
    # The local server reaps leftovers on its own schedule, not before every request.
    manager = SandboxLifecycleManager(
        config=file_cfg, store=store, host_env=con.env, reap_orphans=con.in_process
    )
    streams: dict[str, Any] = {}
    if not args.json:
        streams = {
            "on_stdout": _Stream(con.out.buffer),
            "on_stderr": _Stream(con.err.buffer),
        }
    stdin_data: bytes | None = None
    if args.stdin == "-":
        stdin_data = con.stdin.read()
    elif args.stdin:
        try:
            stdin_data = con.path(args.stdin).read_bytes()
        except OSError as exc:
            raise UsageError(
                f"{PROG} run: --stdin {args.stdin}: {exc.strerror}", EXIT_CANNOT_RUN
            ) from None
    if not args.json:
        manager.bus.on(SandboxEvents.CREATED, lambda _n, event: _warn_weaker(event, con.err))
        manager.bus.on(SandboxEvents.QUEUED, lambda _n, event: _note_queued(event, con.err))
    canceller = _Canceller(manager)
    manager.bus.on(SandboxEvents.CREATED, canceller.created)
    con.on_cancel(canceller.cancel)
    outcome: SandboxOutcome | None = None
    status = 0
    error_line: str | None = None
    lost_node: str | None = None
    # Our stdout carries the command's output or the --json object, nothing else: whatever
    # a library prints during the run goes to stderr (Ray's driver prints a node's death
    # notice on stdout). The warm server's own stdout is no client's: left alone there.
    stdout = sys.stdout
    if con.in_process:
        sys.stdout = sys.stderr
    code_task: CodeTask | None = None
    try:
        task: Any = command
        if code is not None:
            cfg = manager.config_for(cfg, command)
            task = code_task = CodeTask(
                code,
                args.language,
                after=_copy_outs(args.copy_out, con),
                idle_timeout_s=cfg.idle_timeout_s,
                stdin=stdin_data,
                **streams,
            )
        elif args.copy_out:
            cfg = manager.config_for(cfg, command)
            task = _with_copy_out(
                command, cfg, args.copy_out, stdin=stdin_data, streams=streams, con=con
            )
        outcome = manager.run_in_sandbox(task, cfg, stdin=stdin_data, secrets=secrets, **streams)
        status = outcome.exit_code
    except SandboxTimeoutError as exc:
        outcome, status, error_line = exc.outcome, EXIT_TIMEOUT, str(exc)
    except QuotaExceededError as exc:
        outcome, status, error_line = exc.outcome, EXIT_KILLED, str(exc)
    except SandboxCancelledError as exc:
        outcome, status, error_line = exc.outcome, EXIT_INTERRUPTED, str(exc)
    except SandboxLostError as exc:
        # The node died mid-run: no outcome, but where and why (exit 125, as any failure
        # of the infrastructure).
        status, error_line, lost_node = EXIT_CANNOT_RUN, str(exc), exc.node
    except SandboxPreFlightError as exc:
        status, error_line = EXIT_CANNOT_RUN, str(exc)
        if exc.result is not None and not args.json:
            tail = exc.result.stderr.text.strip().splitlines()[-1:]
            if tail:
                error_line += f" ({tail[0]})"
    finally:
        try:
            manager.shutdown()
        finally:
            sys.stdout = stdout
    saved = _save_images(code_task, args.outputs, con) if code_task is not None else None
    if args.json:
        if outcome is not None:
            payload = outcome.to_json()
            payload["exit_code"] = status
            if saved is not None:
                payload.update(saved)
        else:
            payload = {"exit_code": status, "error": error_line}
            if lost_node is not None:
                payload["node"] = lost_node
        con.out.write(json.dumps(payload) + "\n")
        con.out.flush()
    if error_line:
        print(f"{PROG}: {error_line}", file=con.err)
    return status


def _save_images(task: CodeTask, dest: Path | None, con: Console) -> dict[str, Any]:
    """``--code``'s images: saved into ``--outputs DIR`` if given (never through a link
    there), and their listing for ``--json`` (with ``path`` when saved)."""
    found = task.images.to_json()
    if dest is not None and task.images.images:
        folder = con.path(dest)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"{PROG} run: --outputs {dest}: {exc.strerror}", EXIT_CANNOT_RUN
            ) from None
        for listing, image in zip(found["images"], task.images.images, strict=True):
            target = folder / image.name  # a plain file name: listed from one directory
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(target, flags, 0o644)
                with os.fdopen(fd, "wb") as out:
                    out.write(image.data)
            except OSError as exc:
                raise UsageError(
                    f"{PROG} run: --outputs {dest}: {image.name}: {exc.strerror}",
                    EXIT_CANNOT_RUN,
                ) from None
            listing["path"] = str(target)
    for skipped in task.images.skipped:
        if dest is not None:
            print(f"{PROG}: {skipped.name}: not saved: {skipped.reason}", file=con.err)
    return found


def _read_code(args: argparse.Namespace, command: list[str], con: Console) -> bytes:
    if args.code is None or args.language is None:
        raise UsageError(f"{PROG} run: --code FILE and --language go together", EXIT_CANNOT_RUN)
    if command:
        raise UsageError(f"{PROG} run: --code runs FILE; give no COMMAND", EXIT_CANNOT_RUN)
    try:
        return con.path(args.code).read_bytes()
    except OSError as exc:
        raise UsageError(
            f"{PROG} run: --code {args.code}: {exc.strerror}", EXIT_CANNOT_RUN
        ) from None


def _copy_outs(pairs: list[tuple[str, str]], con: Console) -> Any:
    if not pairs:
        return None

    def after(sandbox: Sandbox, _result: ExecResult) -> None:
        for src, dest in pairs:
            sandbox.copy_out(src, con.path(dest))

    return after


def _with_copy_out(
    command: list[str],
    cfg: SandboxLifecycleConfig,
    pairs: list[tuple[str, str]],
    *,
    stdin: bytes | None,
    streams: dict[str, Any],
    con: Console,
) -> Any:
    """The run's task: the command, then (if it ran to its own end) each ``--copy-out``."""

    def task(sandbox: Sandbox) -> ExecResult:
        result = sandbox.exec(command, idle_timeout_s=cfg.idle_timeout_s, stdin=stdin, **streams)
        if not (result.timed_out or result.idle_timed_out or sandbox.violation):
            for src, dest in pairs:
                sandbox.copy_out(src, con.path(dest))
        return result

    return task


def _note_queued(event: dict[str, Any], err: IO[str]) -> None:
    """One stderr line when a placing driver waits for a free slot (--driver ray)."""
    print(
        f"{PROG}: waiting for a free {event.get('resource', 'sandbox')} slot "
        "(every one is taken; the wait ends at the total timeout)",
        file=err,
        flush=True,
    )


def _warn_weaker(event: dict[str, Any], err: IO[str]) -> None:
    """One stderr line, before the task runs, naming each default layer not in effect."""
    warnings = event.get("warnings") or []
    if warnings:
        print(
            f"{PROG}: warning: running with weaker isolation: {'; '.join(warnings)}",
            file=err,
            flush=True,
        )

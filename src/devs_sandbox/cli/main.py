"""The ``devs-sandbox`` command: a thin shell over the library API.

Exit status of ``run`` follows timeout(1): the command's own status; 124 when
the total (or idle) timeout fired; 137 when the sandbox was killed for a quota
violation; 125 when the sandbox could not run (bad option or config, missing
required isolation, preflight failure, driver failure). Other subcommands exit
0, 1 on a devs-sandbox error, 2 on bad usage. Every error is one line on stderr;
no traceback reaches a user unless ``--log-level debug`` asks for it.

The entry point is ``cli/fast.py``: it hands ``run`` to the warm local server when one
answers, and comes here otherwise (and for every other subcommand).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any, Final

from devs_sandbox.cli.console import (
    EXIT_CANNOT_RUN,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    Console,
    RunInCaller,
    UsageError,
)
from devs_sandbox.cli.parser import build_parser
from devs_sandbox.errors import ConfigError, DevsSandboxError, UntrustedConfigError

logger = logging.getLogger("devs_sandbox.cli")


def _command(name: str) -> Any:
    """The subcommand's function, imported when it runs (``run`` needs no MCP, no Docker)."""
    if name == "run":
        from devs_sandbox.cli.run import cmd_run  # noqa: PLC0415

        return cmd_run
    if name == "completion":  # the one command that imports shtab
        from devs_sandbox.cli.completion import cmd_completion  # noqa: PLC0415

        return cmd_completion
    from devs_sandbox.cli import commands  # noqa: PLC0415

    return getattr(commands, f"cmd_{name}")


_PARSER: list[Any] = []
_PARSER_LOCK = threading.Lock()


def _shared_parser() -> Any:
    with _PARSER_LOCK:
        if not _PARSER:
            _PARSER.append(build_parser())
        return _PARSER[0]


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # Unwind through every ``finally`` so the sandbox is destroyed, then exit 128 + N.
    raise SystemExit(128 + signum)


EXIT_BROKEN_PIPE: Final = 128 + signal.SIGPIPE


def _silence(out: Any) -> None:
    """Point a stream whose reader is gone at /dev/null (the in-process CLI's stdout)."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _setup_logging(level: str, err: Any) -> None:
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("devs_sandbox")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Run one invocation; ``console`` is the world it sees (default: this process's)."""
    con = console or Console.current()
    # A process runs one command and builds the parser once; the local server keeps one for
    # every request (building it costs milliseconds, mostly argparse's gettext lookups).
    parser = build_parser() if con.in_process else _shared_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(args_list)
    except UsageError as exc:
        print(exc, file=con.err)
        return exc.status
    if args.cmd == "kubernetes":  # `kubernetes manifest` takes every run option
        args.run_options, extra = extra, []
    if extra:
        status = EXIT_CANNOT_RUN if args.cmd == "run" else EXIT_USAGE
        where = f"{PROG} {args.cmd}" if args.cmd else PROG
        print(f"{where}: unrecognized arguments: {' '.join(extra)}", file=con.err)
        return status
    if con.in_process:  # the server keeps its own logging; a client asking for more runs here
        _setup_logging(args.log_level, con.err)
    if args.cmd is None:
        parser.print_help(con.err)
        return EXIT_USAGE
    if args.cmd == "config" and args.config_cmd is None:
        print(f"{PROG} config: choose 'schema' or 'show'", file=con.err)
        return EXIT_USAGE
    # SIGTERM, and SIGHUP (the terminal closed), unwind like an error: the sandbox is
    # destroyed on the way out.
    previous = (
        {sig: signal.signal(sig, _on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
        if con.in_process
        else None
    )
    failure_status = EXIT_CANNOT_RUN if args.cmd == "run" else EXIT_ERROR
    try:
        status = int(_command(args.cmd)(args, con))
        con.out.flush()  # a closed pipe shows here, not at the interpreter's exit
    except UsageError as exc:
        print(exc, file=con.err)
        return exc.status
    except RunInCaller:
        raise  # the local server hands the request back to its client
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=con.err)
        # A working directory's config trying to weaken the sandbox: nothing may run.
        refused = args.cmd == "run" or isinstance(exc, UntrustedConfigError)
        return EXIT_CANNOT_RUN if refused else EXIT_USAGE
    except DevsSandboxError as exc:
        logger.debug("failure", exc_info=True)
        print(f"{PROG}: {exc}", file=con.err)
        return failure_status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; sandbox destroyed", file=con.err)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`doctor --json | head`): stop quietly, as a CLI killed by
        # SIGPIPE would, and keep the interpreter's final flush from complaining.
        _silence(con.out)
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        # A bug of ours, not bad input: still one line, the traceback only on request.
        logger.debug("internal error", exc_info=True)
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {exc} "
            "(rerun with --log-level debug for details)",
            file=con.err,
        )
        return failure_status
    else:
        return status
    finally:
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)

"""Exec in a container: output, status, stdin, timeouts that kill the whole tree, caps.

Most behaviours are checked on both ways a command runs: the first exec goes through
the container's launcher, later ones (and any with stdin) through ``docker exec``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from devs_sandbox.base import ExecRequest
from devs_sandbox.errors import SandboxNotFoundError
from devs_sandbox.models import SandboxContext
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.docker
PATHS = ["launcher", "docker-exec"]


def ready(driver: Any, ctx: SandboxContext, path: str) -> SandboxContext:
    """Use up the launcher when the test wants the docker-exec path."""
    if path == "docker-exec":
        assert driver.exec(ctx, ExecRequest.of(["true"])).exit_code == 0
    return ctx


def with_marker(marker: str) -> list[psutil.Process]:
    """Host processes with ``marker`` anywhere in their argv (the container's are visible)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in a for a in p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("path", PATHS)
def test_output_status_and_streams_apart(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    pids: list[int] = []
    out = driver.exec(
        ctx,
        ExecRequest.of(
            ["sh", "-c", "echo out; echo err >&2; printf 'no newline'; exit 3"],
            on_start=pids.append,
        ),
    )
    assert out.exit_code == 3 and out.signal is None and not out.timed_out
    assert out.stdout.text == "out\nno newline"
    assert out.stderr.text == "err\n"
    assert out.resources.wall_time_s > 0 and out.resources.peak_processes >= 1
    assert out.resources.cpu_time_s is not None and out.resources.peak_memory_bytes
    assert len(pids) == 1 and pids[0] > 1  # a host pid, reported once


@pytest.mark.parametrize("path", PATHS)
def test_awkward_arguments_arrive_intact(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    args = ["it's", "two\nlines", "$HOME `id`", "", "  spaced  ", "ünï", "-n"]
    out = driver.exec(
        ctx,
        ExecRequest.of(
            ["python3", "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *args]
        ),
    )
    import json

    assert json.loads(out.stdout.text) == args


@pytest.mark.parametrize("path", PATHS)
def test_signals_give_128_plus_n(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    out = driver.exec(ctx, ExecRequest.of(["sh", "-c", "kill -TERM $$"]))
    assert out.exit_code == 128 + 15 and out.signal == 15


@pytest.mark.parametrize("path", PATHS)
def test_command_not_found_is_127(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    assert driver.exec(ctx, ExecRequest.of(["devs-no-such-command"])).exit_code == 127


def test_stdin_is_devnull_unless_given(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox()
    assert driver.exec(ctx, ExecRequest.of(["cat"])).stdout.text == ""  # launcher path: /dev/null
    assert (
        driver.exec(ctx, ExecRequest.of(["cat"])).stdout.text == ""
    )  # docker exec path: /dev/null
    data = b"line one\n" + bytes(range(256)) * 512
    got = driver.exec(ctx, ExecRequest.of(["sh", "-c", "cat | wc -c"], stdin=data))
    assert got.stdout.text.strip() == str(len(data))
    assert driver.exec(ctx, ExecRequest.of(["cat"], stdin=b"")).stdout.text == ""


@pytest.mark.parametrize("path", PATHS)
def test_timeout_kills_a_setsid_grandchild_and_spares_the_sandbox(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    marker = f"devs-test-{uuid.uuid4().hex}"
    script = f"setsid sh -c 'sleep 300; : {marker}' & sh -c 'sleep 300; : {marker}' & wait"
    out = driver.exec(ctx, ExecRequest.of(["sh", "-c", script], timeout_s=1.5))
    assert out.timed_out and out.exit_code == 137 and out.signal == 9
    assert wait_for(lambda: not with_marker(marker), 5), with_marker(marker)
    assert driver.is_running(ctx)
    assert driver.exec(ctx, ExecRequest.of(["echo", "still here"])).stdout.text == "still here\n"


def test_background_grandchild_does_not_hold_the_exec(
    driver: Any, sandbox: Callable[..., SandboxContext]
) -> None:
    ctx = ready(driver, sandbox(), "docker-exec")
    start = time.monotonic()
    out = driver.exec(ctx, ExecRequest.of(["sh", "-c", "sleep 30 & echo started"], timeout_s=20))
    assert out.exit_code == 0 and out.stdout.text == "started\n" and not out.timed_out
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("path", PATHS)
def test_idle_timeout(driver: Any, sandbox: Callable[..., SandboxContext], path: str) -> None:
    ctx = ready(driver, sandbox(), path)
    out = driver.exec(ctx, ExecRequest.of(["sh", "-c", "echo hi; sleep 60"], idle_timeout_s=1.0))
    assert out.idle_timed_out and not out.timed_out and out.exit_code == 137
    assert out.stdout.text == "hi\n"


@pytest.mark.parametrize("path", PATHS)
def test_output_is_capped_head_and_tail(
    driver: Any, sandbox: Callable[..., SandboxContext], path: str
) -> None:
    ctx = ready(driver, sandbox(), path)
    chunks: list[bytes] = []
    script = "echo FIRST; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo LAST"
    out = driver.exec(
        ctx, ExecRequest.of(["sh", "-c", script], max_output_bytes=4096, on_stdout=chunks.append)
    )
    assert out.stdout.truncated and out.stdout.dropped_bytes > 4_000_000
    assert out.stdout.text.startswith("FIRST\n") and out.stdout.text.endswith("LAST\n")
    assert len(out.stdout.text) < 4096 + 100
    assert sum(len(c) for c in chunks) == out.stdout.total_bytes  # streamed whole


def test_nul_bytes_in_output_are_kept(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox()
    out = driver.exec(
        ctx, ExecRequest.of(["printf", "a\\000b\\000devs-exit:\\000"])
    )  # launcher path
    assert out.stdout.text == "a\0b\0devs-exit:\0" and out.exit_code == 0


def test_concurrent_execs_keep_their_own_output(
    driver: Any, sandbox: Callable[..., SandboxContext]
) -> None:
    ctx = sandbox()
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = driver.exec(
            ctx, ExecRequest.of(["sh", "-c", f"sleep 0.2; echo {i}"])
        ).stdout.text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: f"{i}\n" for i in range(4)}


def test_copy_in_seeds_the_workspace_as_the_sandbox_user(
    driver: Any, sandbox: Callable[..., SandboxContext], tmp_path: Path
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("alpha\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "link").symlink_to("sub/a.txt")
    ctx = sandbox(copy_in=tmp_path)
    out = driver.exec(
        ctx, ExecRequest.of(["sh", "-c", "cat link; ./run.sh; stat -c %u sub/a.txt; touch new"])
    )
    assert out.exit_code == 0, out.stderr.text
    assert out.stdout.text == "alpha\nran\n65534\n"


def test_copy_in_over_quota_fails_cleanly(
    driver: Any, sandbox: Callable[..., SandboxContext], tmp_path: Path, engine: Any
) -> None:
    from devs_sandbox.errors import ProvisionError
    from tests.docker.conftest import session_containers

    for i in range(30):
        (tmp_path / f"f{i}").write_text("x")
    before = len(session_containers(engine))
    with pytest.raises(ProvisionError, match="fileCountLimit"):
        sandbox(copy_in=tmp_path, quotas={"file_count_limit": 10})
    assert len(session_containers(engine)) == before


def test_exec_in_a_destroyed_sandbox(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox()
    driver.destroy(ctx)
    with pytest.raises(SandboxNotFoundError):
        driver.exec(ctx, ExecRequest.of(["true"]))
    with pytest.raises(SandboxNotFoundError):
        driver.get_metrics(ctx)
    assert not driver.is_running(ctx)
    driver.force_stop(ctx)  # unknown: a no-op


def test_exec_after_the_container_was_killed(
    driver: Any, sandbox: Callable[..., SandboxContext]
) -> None:
    ctx = sandbox()
    driver.force_stop(ctx)
    assert not driver.is_running(ctx)
    with pytest.raises(SandboxNotFoundError):
        driver.exec(ctx, ExecRequest.of(["true"]))  # the launcher is gone with the container
    with pytest.raises(SandboxNotFoundError):
        driver.exec(ctx, ExecRequest.of(["true"]))  # and the engine refuses a docker exec
    metrics = driver.get_metrics(ctx)
    assert not metrics.running and metrics.process_count == 0


def test_invalid_arguments(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox()
    with pytest.raises(ValueError, match="empty"):
        driver.exec(ctx, ExecRequest.of([]))
    with pytest.raises(ValueError, match="environment"):
        driver.exec(ctx, ExecRequest.of(["true"], env={"A=B": "1"}))
    with pytest.raises(ValueError, match="null byte"):
        driver.exec(ctx, ExecRequest.of(["echo", "a\0b"]))
    with pytest.raises(ValueError, match="null byte"):
        driver.exec(ctx, ExecRequest.of(["true"], env={"A": "a\0b"}))
    odd = driver.exec(ctx, ExecRequest.of(["sh", "-c", 'echo "$A_B"'], env={"A_B": "x y"}))
    assert odd.stdout.text == "x y\n"
    # Not a shell name: the shim's dash drops it (as in the process driver), but it must not
    # break the command.
    dotted = driver.exec(ctx, ExecRequest.of(["echo", "ran"], env={"dotted.name": "1"}))
    assert dotted.exit_code == 0 and dotted.stdout.text == "ran\n"

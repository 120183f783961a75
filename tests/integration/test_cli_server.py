"""``devs-sandbox run`` through the local server (cli/fast.py, cli/server.py).

The server must be invisible: the same exit statuses, output, --json contract, stdin,
configuration trust and violation records as the command in a process of its own, with
the client's environment and working directory; a signal to the client or a client that
vanishes destroys the sandbox; only its own uid can reach it. Every test here runs with
a runtime directory of its own and stops the server it started (by its pid file).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.contracts import task_stderr
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def server_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    runtime = tmp_path / "run"
    env = {
        "DEVS_SANDBOX_DAEMON": "1",
        "DEVS_SANDBOX_RUNTIME_DIR": str(runtime),
        "DEVS_SANDBOX_DAEMON_IDLE_S": "120",
    }
    yield env
    for pid_file in runtime.glob("*.pid"):
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        assert wait_for(lambda p=pid: not _alive(p), 30), f"server {pid} did not stop"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours is gone for our purposes
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False


def started(env: dict[str, str]) -> int:
    """Start the server (the first run spawns it) and wait until it answers."""
    run_cli("run", "--", "true", env=env)
    runtime = Path(env["DEVS_SANDBOX_RUNTIME_DIR"])
    assert wait_for(lambda: list(runtime.glob("*.sock")), 60), "the server never listened"
    return int(next(runtime.glob("*.pid")).read_text())


def via_server(*args: str, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env, **kw)


def test_the_server_path_gives_what_the_process_gives(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    pid = started(server_env)
    cases: list[tuple[str, ...]] = [
        ("run", "--", "sh", "-c", "echo out; echo err >&2; exit 7"),
        ("run", "--timeout", "1", "--", "sleep", "10"),
        ("run", "--memory", "64m", "--", "python3", "-c", "b = bytearray(512 << 20)"),
        ("run", "--max-processes", "-3", "--", "true"),
        ("run", "--preflight", "exit 3", "--", "true"),
    ]
    for args in cases:
        ours = via_server(*args, env=server_env)
        theirs = run_cli(*args)
        assert ours.returncode == theirs.returncode, (args, ours.stderr, theirs.stderr)
        assert ours.stdout == theirs.stdout, args
        assert (
            task_stderr(ours.stderr).splitlines()[:1] == task_stderr(theirs.stderr).splitlines()[:1]
            or "sb-" in ours.stderr
        ), (args, ours.stderr, theirs.stderr)
    doc = json.loads(via_server("run", "--json", "--", "echo", "hi", env=server_env).stdout)
    ref = json.loads(run_cli("run", "--json", "--", "echo", "hi").stdout)
    assert set(doc) == set(ref) and doc["stdout"] == "hi\n" and doc["isolation"] == ref["isolation"]
    fed = via_server("run", "--stdin", "-", "--", "wc", "-c", env=server_env, input=b"x" * 100_000)
    assert fed.stdout.strip() == "100000"
    assert _alive(pid), "the server should still serve"


@pytest.mark.cgroups
def test_each_request_records_in_the_store_of_its_clients_environment(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    started(server_env)
    db = tmp_path / "client.db"
    hog = via_server(
        "run",
        "--memory",
        "64m",
        "--",
        "python3",
        "-c",
        "b = bytearray(512 << 20)",
        env={**server_env, "DEVS_SANDBOX_DB": str(db)},
    )
    assert hog.returncode == 137, hog.stderr
    rows = sqlite3.connect(db).execute("SELECT violation_type FROM sandbox_violations").fetchall()
    assert rows == [("MEMORY_EXCEEDED",)], "recorded in the store of the client's environment"


def test_each_request_uses_its_clients_environment_and_directory(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    started(server_env)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "devs.config.json").write_text(json.dumps({"sandbox": {"network": True}}))
    (repo / "seed.txt").write_text("seeded\n")
    refused = via_server("run", "--", "true", env=server_env, cwd=repo)
    assert refused.returncode == 125 and "sandbox.network" in refused.stderr
    (repo / "devs.config.json").unlink()
    seeded = via_server("run", "--copy-in", ".", "--", "cat", "seed.txt", env=server_env, cwd=repo)
    assert seeded.stdout == "seeded\n", seeded.stderr
    secret = via_server(
        "run",
        "--secret",
        "API_TOKEN",
        "--",
        "sh",
        "-c",
        'test "$(cat "$API_TOKEN_FILE")" = from-the-client && echo match',
        env={**server_env, "API_TOKEN": "from-the-client"},
    )
    assert secret.stdout == "match\n", secret.stderr


def test_a_signal_to_the_client_destroys_the_sandbox(server_env: dict[str, str]) -> None:
    pid = started(server_env)
    marker = f"devs-test-{os.getpid()}-sig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devs_sandbox",
            "run",
            "--json",
            "--",
            "bash",
            "-c",
            f"exec -a {marker} sleep 300",
        ],
        env={**os.environ, **server_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_for(lambda: _with_marker(marker), 30), "the sandbox never started"
    proc.send_signal(signal.SIGTERM)
    _out, _err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_for(lambda: not _with_marker(marker), 10), "the sandbox outlived its client"
    assert _alive(pid)


def test_a_client_that_vanishes_takes_its_sandbox_with_it(server_env: dict[str, str]) -> None:
    started(server_env)
    marker = f"devs-test-{os.getpid()}-kill"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devs_sandbox",
            "run",
            "--",
            "bash",
            "-c",
            f"exec -a {marker} sleep 300",
        ],
        env={**os.environ, **server_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for(lambda: _with_marker(marker), 30)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not _with_marker(marker), 10), "the sandbox outlived its client"


def _with_marker(marker: str) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0].decode().startswith(marker):
                    return True
            except OSError:
                continue
    return False


def test_only_its_own_user_can_reach_the_server(server_env: dict[str, str]) -> None:
    started(server_env)
    runtime = Path(server_env["DEVS_SANDBOX_RUNTIME_DIR"])
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    sock = next(runtime.glob("*.sock"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    if os.geteuid() == 0:
        probe = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--",
                sys.executable,
                "-c",
                "import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
                f"try:\n    s.connect({str(sock)!r}); print('connected')\n"
                "except OSError as e:\n    print('refused', e.errno)\n",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert probe.stdout.startswith("refused"), probe.stdout + probe.stderr


def test_a_directory_that_is_not_ours_is_never_used(tmp_path: Path) -> None:
    runtime = tmp_path / "open"
    runtime.mkdir(mode=0o777)
    runtime.chmod(0o777)
    env = {"DEVS_SANDBOX_DAEMON": "1", "DEVS_SANDBOX_RUNTIME_DIR": str(runtime)}
    r = run_cli("run", "--", "echo", "fine", env=env)
    assert r.returncode == 0 and r.stdout == "fine\n"
    time.sleep(1)
    assert not list(runtime.glob("*.sock")), "a server listened in a directory others can enter"


def test_disabled_means_no_server_at_all(tmp_path: Path) -> None:
    env = {"DEVS_SANDBOX_DAEMON": "0", "DEVS_SANDBOX_RUNTIME_DIR": str(tmp_path / "run")}
    assert run_cli("run", "--", "true", env=env).returncode == 0
    time.sleep(1)
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())

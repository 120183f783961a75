"""The CLI contract, exercised as a user runs it: real process, no stdin."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from devs_sandbox.leases import LeaseRegistry
from devs_sandbox.store import ViolationStore
from tests.conftest import run_cli
from tests.contracts import RESOURCE_KEYS, RUN_JSON_KEYS, task_stderr
from tests.helpers import run_python
from tests.integration.helpers import processes_with, wait_for

pytestmark = pytest.mark.integration


def test_run_json_prints_the_contract() -> None:
    r = run_cli("run", "--json", "--", "python3", "-c", "print(1)")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= RUN_JSON_KEYS
    assert out["stdout"] == "1\n" and out["exit_code"] == 0 and out["driver"] == "process"
    assert out["violation"] is None and out["timed_out"] is False
    assert set(out["resources"]) == RESOURCE_KEYS
    assert "rlimits" in out["isolation"]


def test_a_local_run_never_imports_ray() -> None:
    """Ray (~1 s to import) is loaded only by --driver ray: the CLI's start-up is part of
    every sandboxed command."""
    probe = (
        "import sys\n"
        "from devs_sandbox.cli.fast import main\n"
        "status = main(['run', '--', 'true'])\n"
        "print(status, sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    r = run_python(probe)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(maxsplit=1) == ["0", "[]\n"], (r.stdout, r.stderr)


def test_module_entry_point_and_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and "devs-sandbox" in r.stdout


def test_exit_status_is_the_commands() -> None:
    assert run_cli("run", "--", "sh", "-c", "exit 7").returncode == 7


def test_output_streams_to_our_own_without_json() -> None:
    r = run_cli("run", "--", "sh", "-c", "echo out; echo err >&2")
    assert r.stdout == "out\n" and task_stderr(r.stderr) == "err\n"


def test_output_streams_as_it_comes_not_after_the_end() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devs_sandbox",
            "run",
            "--",
            "sh",
            "-c",
            "echo first; sleep 3; echo second",
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    start = time.monotonic()
    first = proc.stdout.readline()
    elapsed = time.monotonic() - start
    rest = proc.stdout.read()
    proc.wait(30)
    assert first == b"first\n" and rest == b"second\n"
    assert elapsed < 2.5, f"first line took {elapsed:.2f}s: output was buffered to the end"


def test_timeout_exits_124_with_one_line() -> None:
    r = run_cli("run", "--timeout", "1", "--", "sleep", "30")
    assert r.returncode == 124
    lines = task_stderr(r.stderr).strip().splitlines()
    assert len(lines) == 1 and "timed out" in lines[0] and "--timeout" in lines[0]


def test_timeout_json() -> None:
    r = run_cli("run", "--json", "--timeout", "0.5", "--", "sleep", "30")
    out = json.loads(r.stdout)
    assert r.returncode == 124 and out["exit_code"] == 124 and out["timed_out"] is True


@pytest.mark.cgroups
def test_memory_violation_exits_137_and_is_listed(tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    r = run_cli(
        "run",
        "--json",
        "--db",
        str(db),
        "--memory",
        "48m",
        "--",
        "python3",
        "-c",
        "x = bytearray(200 * 1024 * 1024)",
    )
    assert r.returncode == 137, r.stderr
    out = json.loads(r.stdout)
    assert out["violation"]["type"] == "MEMORY_EXCEEDED"
    assert out["violation"]["limit_value"] == 48 * 1024 * 1024
    assert "MEMORY_EXCEEDED" in r.stderr
    listed = run_cli("violations", "--db", str(db), "--json")
    rows = json.loads(listed.stdout)
    assert len(rows) == 1 and rows[0]["sandbox_id"] == out["sandbox_id"]
    assert set(rows[0]) >= {
        "violation_id",
        "sandbox_id",
        "violation_type",
        "observed_value",
        "limit_value",
        "terminated_at",
    }
    table = run_cli("violations", "--db", str(db))
    assert "MEMORY_EXCEEDED" in table.stdout
    only = run_cli("violations", "--db", str(db), "--sandbox-id", "nope", "--json")
    assert json.loads(only.stdout) == []


@pytest.mark.cgroups
def test_fork_bomb_exits_137(tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    r = run_cli(
        "run",
        "--db",
        str(db),
        "--max-processes",
        "32",
        "--poll-interval",
        "200",
        "--",
        "sh",
        "-c",
        "while :; do sleep 100 & done",
    )
    assert r.returncode == 137
    assert "PROCESS_COUNT_EXCEEDED" in r.stderr
    assert ViolationStore(db).count() == 1


def test_db_from_environment_variable(tmp_path: Path) -> None:
    db = tmp_path / "env.db"
    r = run_cli("violations", "--json", env={"DEVS_SANDBOX_DB": str(db)})
    assert r.returncode == 0 and json.loads(r.stdout) == []
    assert db.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--sandbox-id", "../../etc", "--", "true"], "invalid sandbox id"),
        (["run", "--sandbox-id", "x" * 65, "--", "true"], "invalid sandbox id"),
        (["run", "--memory", "-5m", "--", "true"], "--memory"),
        (["run", "--memory", "lots", "--", "true"], "invalid size"),
        (["run", "--memory", "inf", "--", "true"], "invalid size"),
        (["run", "--max-file-size", "1e400", "--", "true"], "invalid size"),
        (["run", "--env", "A-B=1", "--", "true"], "invalid environment variable"),
        (["run", "--timeout", "0", "--", "true"], "--timeout"),
        (["run", "--max-processes", "abc", "--", "true"], "--max-processes"),
        (["run", "--no-such-option", "--", "true"], "unrecognized arguments"),
        (["run", "--env", "NOEQUALS", "--", "true"], "KEY=VALUE"),
        (["run"], "missing COMMAND"),
        (["run", "--driver", "vm", "--", "true"], "invalid choice"),
        (["run", "--config", "/nonexistent/devs.json", "--", "true"], "config file not found"),
        (["run", "--strict", "--require", "warp-drive", "--", "true"], "warp-drive"),
    ],
)
def test_bad_input_is_one_line_and_125(args: list[str], needle: str) -> None:
    r = run_cli(*args)
    assert r.returncode == 125, (r.returncode, r.stderr)
    lines = task_stderr(r.stderr).strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_malformed_config_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "devs.config.json"
    cfg.write_text(json.dumps({"sandbox": {"quotas": {"processCountLimit": "many"}}}))
    r = run_cli("run", "--config", str(cfg), "--", "true")
    assert r.returncode == 125
    assert "sandbox.quotas.processCountLimit" in r.stderr
    implicit = run_cli("run", "--", "true", cwd=tmp_path)
    assert implicit.returncode == 125 and "processCountLimit" in implicit.stderr


def test_preflight_failure_is_125_and_the_task_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = run_cli(
        "run",
        # With network where the host can isolate it (pasta), else without: either way
        # the preflight failure must win.
        *(["--network"] if shutil.which("pasta") else []),
        "--preflight",
        "true",
        "--preflight",
        "echo nope >&2; exit 4",
        "--",
        "sh",
        "-c",
        f"echo ran > {marker}",
    )
    assert r.returncode == 125
    assert "preflight" in r.stderr and "exit" in r.stderr
    assert not marker.exists()


def test_config_schema_and_show(tmp_path: Path) -> None:
    schema = json.loads(run_cli("config", "schema").stdout)
    assert schema["title"] == "devs.config.json"
    (tmp_path / "devs.config.json").write_text(json.dumps({"sandbox": {"timeoutMs": 1234}}))
    shown = json.loads(run_cli("config", "show", "--json", cwd=tmp_path).stdout)
    assert shown["config"]["sandbox"]["timeoutMs"] == 1234
    assert shown["sources"]["sandbox.timeoutMs"].endswith("/devs.config.json")
    assert shown["sources"]["sandbox.quotas.memoryBytes"] == "default"
    assert shown["config"]["sandbox"]["quotas"]["fileCountLimit"] == 10_000


def test_doctor_reports_every_mechanism() -> None:
    r = run_cli("doctor", "--json")
    assert r.returncode == 0
    report = json.loads(r.stdout)
    assert set(report["mechanisms"]) >= {
        "rlimits",
        "cgroup",
        "pid-namespace",
        "mount-namespace",
        "net-namespace",
        "tmpfs-workspace",
        "unprivileged-user",
    }
    for info in report["mechanisms"].values():
        assert info["available"] or info["reason"]
    human = run_cli("doctor")
    assert "cgroup" in human.stdout and "rlimits" in human.stdout


def start_cli_sleeper() -> tuple[subprocess.Popen[bytes], str]:
    """``devs-sandbox run`` of a sleeper whose argv[0] is a unique marker, once it runs."""
    marker = f"devs-test-{uuid.uuid4().hex}"
    argv = [sys.executable, "-m", "devs_sandbox", "run", "--", "bash", "-c"]
    proc = subprocess.Popen(
        [*argv, f"exec -a {marker} sleep 300"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for(lambda: processes_with(marker), 15)
    return proc, marker


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_to_the_cli_destroys_the_sandbox(sig: signal.Signals) -> None:
    """SIGHUP is what closing the terminal sends: it cleans up as SIGTERM does (workspace,
    tmpfs mount, cgroups and lease gone at once, not at the next start)."""
    proc, marker = start_cli_sleeper()
    mine = [lease for _, lease in LeaseRegistry().all() if lease and lease.owner.pid == proc.pid]
    assert mine, "the run took no lease"
    proc.send_signal(sig)
    proc.wait(30)
    assert proc.returncode == 128 + sig
    assert wait_for(lambda: not processes_with(marker), 5)
    for lease in mine:
        assert not Path(lease.workspace).exists(), lease.workspace
        assert LeaseRegistry().read(lease.sandbox_id) is None


def test_a_crashed_owner_is_reaped_by_cleanup_and_on_next_start() -> None:

    for command in (["cleanup"], ["run", "--", "true"]):
        owner, marker = start_cli_sleeper()
        # Only the crashed owner's sandbox: other test sessions may share this host.
        mine = [
            lease for _, lease in LeaseRegistry().all() if lease and lease.owner.pid == owner.pid
        ]
        workspaces = {Path(lease.workspace) for lease in mine}
        owner.send_signal(signal.SIGKILL)  # no finally, no destroy: a crash
        owner.wait(10)
        assert len(mine) == 1 and all(ws.exists() for ws in workspaces)
        r = run_cli(*command)
        assert r.returncode == 0, r.stderr
        if command == ["cleanup"]:
            # Another devs-sandbox process on this host may have reaped it first.
            assert f"reaped process sandbox {mine[0].sandbox_id}" in r.stdout or not any(
                ws.exists() for ws in workspaces
            )
        assert wait_for(lambda m=marker: not processes_with(m), 5)
        for ws in workspaces:
            assert not ws.exists()
        assert LeaseRegistry().read(mine[0].sandbox_id) is None


def test_stdin_option_feeds_the_command(tmp_path: Path) -> None:
    data = tmp_path / "in.txt"
    data.write_text("from a file\n")
    r = run_cli("run", "--stdin", str(data), "--", "cat")
    assert r.stdout == "from a file\n"
    piped = run_cli("run", "--stdin", "-", "--", "cat", input=b"piped\n")
    assert piped.stdout == "piped\n"
    default = run_cli("run", "--", "cat")
    assert default.stdout == "" and default.returncode == 0


def test_a_reader_that_goes_away_is_not_an_error() -> None:
    """`devs-sandbox doctor --json | head`: quiet, as a CLI killed by SIGPIPE (here the
    reader, `true`, is gone before the CLI has imported itself)."""
    script = (
        f'{sys.executable} -m devs_sandbox doctor --json | true; echo "s=${{PIPESTATUS[0]}}" >&2'
    )
    proc = subprocess.run(
        ["/bin/bash", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "DEVS_SANDBOX_DAEMON": "0"},
        timeout=60,
        check=False,
    )
    assert "Error" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert "s=141" in proc.stderr


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--timeout", "100000"],
            "devs-sandbox run: --timeout 100000: must be at most 86400 seconds",
        ),
        (["--memory", "1k"], "devs-sandbox run: --memory 1024: must be at least 4194304 bytes"),
        (["--max-output", "1"], "devs-sandbox run: --max-output 1: must be at least 64 bytes"),
    ],
)
def test_a_bound_is_said_in_the_options_terms(options: list[str], expected: str) -> None:
    """The option the user typed and its unit, not the config key in milliseconds."""
    proc = run_cli("run", *options, "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.strip() == expected
    assert "Ms" not in proc.stderr and "sandbox." not in proc.stderr


def test_copy_out_brings_results_home_and_nothing_else(tmp_path: Path) -> None:
    dest = tmp_path / "results"
    script = "mkdir -p out/sub && echo 42 > out/sub/answer && printf x > single && echo ran"
    ok = run_cli(
        "run", "--copy-out", f"out:{dest}", "--copy-out", f"single:{dest}", "--", "sh", "-c", script
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "ran\n"
    assert (dest / "out" / "sub" / "answer").read_text() == "42\n"
    assert (dest / "single").read_text() == "x"
    bad = tmp_path / "bad"
    escape = run_cli(
        "run", "--copy-out", f"out:{bad}", "--", "sh", "-c", "mkdir out; ln -s /etc/shadow out/s"
    )
    assert escape.returncode == 125
    assert escape.stderr.strip().endswith("a link to an absolute path")
    assert not (bad / "out").exists()
    outside = run_cli("run", "--copy-out", f"../etc:{bad}", "--", "true")
    assert outside.returncode == 125 and "inside the workspace" in outside.stderr
    malformed = run_cli("run", "--copy-out", "nocolon", "--", "true")
    assert malformed.returncode == 125 and "SRC:DEST" in malformed.stderr


def test_code_by_language_with_its_outputs(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text('print(sum(range(10)))\nopen("outputs/plot.svg", "w").write("<svg/>")\n')
    dest = tmp_path / "got"
    ok = run_cli(
        "run", "--code", str(prog), "--language", "python", "--copy-out", f"outputs:{dest}"
    )
    assert (ok.returncode, ok.stdout) == (0, "45\n"), ok.stderr
    assert (dest / "outputs" / "plot.svg").read_text() == "<svg/>"
    script = tmp_path / "s.sh"
    script.write_text("echo from bash; exit 3\n")
    run = run_cli("run", "--code", str(script), "--language", "bash")
    assert (run.returncode, run.stdout) == (3, "from bash\n")
    alone = run_cli("run", "--code", str(script))
    assert alone.returncode == 125 and "--language" in alone.stderr
    both = run_cli("run", "--code", str(script), "--language", "bash", "--", "true")
    assert both.returncode == 125 and "give no COMMAND" in both.stderr
    missing = run_cli("run", "--code", str(tmp_path / "nope.py"), "--language", "python")
    assert missing.returncode == 125 and "nope.py" in missing.stderr

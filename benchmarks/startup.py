"""Per-run overhead of devs-sandbox against a bare subprocess, in the same run.

Cases (each runs `true`, create + run + destroy, interleaved):
- bare:           subprocess.run(["true"])
- bwrap:          bwrap with the same namespaces, no cgroup, no tmpfs (the tool's floor)
- library:        SandboxLifecycleManager.run_in_sandbox, full isolation available here
                  (bwrap namespaces, seccomp, cgroup, tmpfs root, own uid)
- library-unshare: the same layers through our unshare(2) launcher (hosts without bwrap)
- library-cgroup: without namespaces or seccomp (rlimits + cgroup + tmpfs)
- cli:            `devs-sandbox run -- true` end to end, through the warm local server
- cli-in-process: the same with DEVS_SANDBOX_DAEMON=0 (every import paid by the call)
- docker-run:     `docker run --rm` of the locally built default image, the same `true`

Targets: library - bare <= 15 ms at the median (issue 2, kept by issue 9 with every new
layer on); cli <= 50 ms and <= 0.25x docker run (issue 10); on a 2-core machine.
Usage: python benchmarks/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devs_sandbox import SandboxLifecycleConfig, SandboxLifecycleManager, override

from _common import summarize, time_interleaved, write_report

TARGET_OVERHEAD_MS = 15.0
TARGET_CLI_MS = 50.0  # issue 10: `devs-sandbox run -- true` end to end
TARGET_CLI_VS_DOCKER = 0.25
DOCKER_IMAGE = "devs-sandbox/default"  # built offline; `devs-sandbox image build`


def _cli_cases(runs: int) -> dict[str, list[float]]:
    """The command as an agent calls it: through the warm local server (the default), in a
    process of its own, and `docker run --rm` of a small local image beside it."""
    exe = str(Path(sys.executable).parent / "devs-sandbox")
    runtime = tempfile.mkdtemp(prefix="devs-bench-run-")
    server = {**os.environ, "DEVS_SANDBOX_DAEMON": "1", "DEVS_SANDBOX_RUNTIME_DIR": runtime}
    alone = {**os.environ, "DEVS_SANDBOX_DAEMON": "0"}
    cases: dict[str, Any] = {
        "cli": lambda: subprocess.run([exe, "run", "--", "true"], env=server, check=True),
        "cli-in-process": lambda: subprocess.run([exe, "run", "--", "true"], env=alone, check=True),
        "python-startup": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    }
    if (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "image", "inspect", DOCKER_IMAGE], capture_output=True, check=False
        ).returncode
        == 0
    ):
        cases["docker-run"] = lambda: subprocess.run(
            ["docker", "run", "--rm", "--network", "none", DOCKER_IMAGE, "true"],
            stdout=subprocess.DEVNULL,
            check=True,
        )
    subprocess.run([exe, "run", "--", "true"], env=server, check=True)  # starts the server
    deadline = time.monotonic() + 60
    while not list(Path(runtime).glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        return time_interleaved(cases, runs, warmup=2)
    finally:
        for pid_file in Path(runtime).glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--cli-runs", type=int, default=30)
    args = ap.parse_args()

    manager = SandboxLifecycleManager(store=None)
    full = SandboxLifecycleConfig()
    unshare = override(full, isolation={"use_bwrap": False})
    no_ns = override(
        full, isolation={"namespaces": False, "seccomp": False, "allow_weaker_isolation": True}
    )
    isolation = manager.run_in_sandbox(["true"], full).isolation
    ws = Path(tempfile.mkdtemp(prefix="devs-bench-"))
    bwrap = shutil.which("bwrap")
    cases = {
        "bare": lambda: subprocess.run(["true"], check=True),
        "library": lambda: manager.run_in_sandbox(["true"], full),
        "library-unshare": lambda: manager.run_in_sandbox(["true"], unshare),
        "library-cgroup": lambda: manager.run_in_sandbox(["true"], no_ns),
    }
    if bwrap:
        argv = [
            bwrap,
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--bind",
            str(ws),
            str(ws),
            "--",
            "true",
        ]
        cases["bwrap"] = lambda: subprocess.run(argv, check=True)
    samples = time_interleaved(cases, args.runs)
    shutil.rmtree(ws, ignore_errors=True)
    cli_samples = _cli_cases(args.cli_runs)
    samples.update(cli_samples)

    stats = {name: summarize(s) for name, s in samples.items()}
    bare = stats["bare"]["p50_ms"]
    overhead = stats["library"]["p50_ms"] - bare
    print(f"isolation in effect: {', '.join(isolation)}")
    print(f"{'case':<20} {'p50 ms':>8} {'p90 ms':>8} {'x bare':>8} {'+ms vs bare':>12}")
    for name, st in stats.items():
        print(
            f"{name:<20} {st['p50_ms']:8.2f} {st['p90_ms']:8.2f} "
            f"{st['p50_ms'] / bare:8.1f} {st['p50_ms'] - bare:12.2f}"
        )
    verdict = "PASS" if overhead <= TARGET_OVERHEAD_MS else "FAIL"
    print(
        f"library overhead at the median: {overhead:.2f} ms "
        f"(target <= {TARGET_OVERHEAD_MS}) {verdict}"
    )
    cli = stats["cli"]["p50_ms"]
    docker = stats.get("docker-run", {}).get("p50_ms")
    cli_ok = cli <= TARGET_CLI_MS and (docker is None or cli <= TARGET_CLI_VS_DOCKER * docker)
    ratio = (
        f", {cli / docker:.2f}x docker run --rm (target <= {TARGET_CLI_VS_DOCKER})"
        if docker
        else ""
    )
    print(
        f"cli `run -- true` at the median: {cli:.1f} ms (target <= {TARGET_CLI_MS}){ratio} "
        f"{'PASS' if cli_ok else 'FAIL'}"
    )
    path = write_report(
        "startup",
        {
            "isolation": list(isolation),
            "stats": stats,
            "ratios_vs_bare": {n: st["p50_ms"] / bare for n, st in stats.items()},
            "cli_vs_docker_run": (cli / docker) if docker else None,
            "cli_vs_bwrap": cli / stats["bwrap"]["p50_ms"] if "bwrap" in stats else None,
            "library_overhead_ms": overhead,
            "target_overhead_ms": TARGET_OVERHEAD_MS,
            "target_cli_ms": TARGET_CLI_MS,
            "pass": overhead <= TARGET_OVERHEAD_MS,
            "cli_pass": cli_ok,
        },
    )
    print(f"wrote {path}")
    manager.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-run overhead of devs-sandbox against a bare subprocess, in the same run.

Cases (each runs `true`, create + run + destroy, interleaved):
- bare:           subprocess.run(["true"])
- bwrap:          bwrap with the same namespaces, no cgroup, no tmpfs (the tool's floor)
- library:        SandboxLifecycleManager.run_in_sandbox, full isolation available here
                  (bwrap namespaces, seccomp, cgroup, tmpfs root, own uid)
- library-unshare: the same layers through our unshare(2) launcher (hosts without bwrap)
- library-cgroup: without namespaces or seccomp (rlimits + cgroup + tmpfs)
- cli:            `devs-sandbox run -- true` end to end (includes Python start-up)

Target (issue 2): library - bare <= 15 ms at the median on a 2-core machine.
Usage: python benchmarks/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from devs_sandbox import SandboxLifecycleConfig, SandboxLifecycleManager, override

from _common import summarize, time_interleaved, write_report

TARGET_OVERHEAD_MS = 15.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--cli-runs", type=int, default=10)
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
    cli = time_interleaved(
        {
            "cli": lambda: subprocess.run(
                [sys.executable, "-m", "devs_sandbox", "run", "--", "true"], check=True
            ),
            "python-startup": lambda: subprocess.run(
                [sys.executable, "-c", "import devs_sandbox.cli"], check=True
            ),
        },
        args.cli_runs,
        warmup=1,
    )
    samples.update(cli)
    shutil.rmtree(ws, ignore_errors=True)

    stats = {name: summarize(s) for name, s in samples.items()}
    bare = stats["bare"]["p50_ms"]
    overhead = stats["library"]["p50_ms"] - bare
    print(f"isolation in effect: {', '.join(isolation)}")
    print(f"{'case':<16} {'p50 ms':>8} {'p90 ms':>8} {'x bare':>8} {'+ms vs bare':>12}")
    for name, st in stats.items():
        print(
            f"{name:<16} {st['p50_ms']:8.2f} {st['p90_ms']:8.2f} "
            f"{st['p50_ms'] / bare:8.1f} {st['p50_ms'] - bare:12.2f}"
        )
    verdict = "PASS" if overhead <= TARGET_OVERHEAD_MS else "FAIL"
    print(
        f"library overhead at the median: {overhead:.2f} ms "
        f"(target <= {TARGET_OVERHEAD_MS}) {verdict}"
    )
    path = write_report(
        "startup",
        {
            "isolation": list(isolation),
            "stats": stats,
            "ratios_vs_bare": {n: st["p50_ms"] / bare for n, st in stats.items()},
            "library_overhead_ms": overhead,
            "target_overhead_ms": TARGET_OVERHEAD_MS,
            "pass": overhead <= TARGET_OVERHEAD_MS,
        },
    )
    print(f"wrote {path}")
    manager.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-run cost of the Docker driver against plain ``docker run --rm`` of the same image.

Cases (each runs `true`, create + run + destroy, interleaved run by run):
- docker-run:          `docker run --rm IMAGE true` (the engine's own CLI; no hardening)
- docker-run-hardened: the same with the driver's flags (cap-drop, read-only, tmpfs, limits)
- driver:              SandboxLifecycleManager.run_in_sandbox(["true"]) with the docker driver
Then, apart (a pool refills in the background, which would disturb interleaved cases):
- driver-warm:         the same with docker.warmPoolSize=2 (containers created and started
                       ahead of time); each timed run waits, untimed, for a ready container

Targets (issue 4): driver <= 1.10 x docker-run at the median; driver-warm p50 < 50 ms.
Usage: python benchmarks/docker_startup.py [--runs N] [--warm-runs N]
"""

from __future__ import annotations

import argparse
import subprocess
import time

from devs_sandbox import SandboxLifecycleConfig, SandboxLifecycleManager, override
from devs_sandbox.drivers.docker import DockerDriver

from _common import summarize, time_interleaved, write_report

TARGET_RATIO = 1.10
TARGET_WARM_MS = 50.0
POOL_WAIT_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warm-runs", type=int, default=30)
    args = ap.parse_args()

    driver = DockerDriver(extra_labels={"devs.bench": "docker_startup"})
    manager = SandboxLifecycleManager(driver, store=None)
    cold = override(SandboxLifecycleConfig(), driver="docker")
    first = manager.run_in_sandbox(["true"], cold)  # resolves (or builds) the default image
    image = driver.resolve_image(cold).reference
    hardened = [
        "docker",
        "run",
        "--rm",
        "--init",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges:true",
        "--read-only",
        "--network=none",
        "--memory=2g",
        "--memory-swap=2g",
        "--pids-limit=514",
        "--tmpfs=/workspace:rw,exec,size=1g",
        "--tmpfs=/tmp:rw,exec,size=64m",
        "--log-driver=none",
        "--user=65534:65534",
        image,
        "true",
    ]
    cases = {
        "docker-run": lambda: subprocess.run(["docker", "run", "--rm", image, "true"], check=True),
        "docker-run-hardened": lambda: subprocess.run(hardened, check=True),
        "driver": lambda: manager.run_in_sandbox(["true"], cold),
    }
    samples = time_interleaved(cases, args.runs)

    warm_cfg = override(cold, docker={"warm_pool_size": 2})
    manager.run_in_sandbox(["true"], warm_cfg)  # asks for the pool; it fills in the background
    warm: list[float] = []
    for _ in range(args.warm_runs):
        end = time.monotonic() + POOL_WAIT_S
        while not driver.pool.ids() and time.monotonic() < end:
            time.sleep(0.01)  # untimed: the pool refills between runs
        start = time.perf_counter()
        manager.run_in_sandbox(["true"], warm_cfg)
        warm.append((time.perf_counter() - start) * 1000)
    samples["driver-warm"] = warm
    manager.shutdown()

    stats = {name: summarize(s) for name, s in samples.items()}
    base = stats["docker-run"]["p50_ms"]
    ratio = stats["driver"]["p50_ms"] / base
    warm_p50 = stats["driver-warm"]["p50_ms"]
    print(f"image {image}; isolation in effect: {', '.join(first.isolation)}")
    print(f"{'case':<20} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'x docker-run':>13}")
    for name, st in stats.items():
        print(
            f"{name:<20} {st['n']:4d} {st['p50_ms']:8.1f} {st['p90_ms']:8.1f} "
            f"{st['p50_ms'] / base:13.2f}"
        )
    ratio_ok = ratio <= TARGET_RATIO
    warm_ok = warm_p50 < TARGET_WARM_MS
    print(
        f"driver / docker-run at the median: {ratio:.2f} (target <= {TARGET_RATIO}) "
        f"{'PASS' if ratio_ok else 'FAIL'}"
    )
    print(
        f"warm pool p50: {warm_p50:.1f} ms (target < {TARGET_WARM_MS}) "
        f"{'PASS' if warm_ok else 'FAIL'}"
    )
    path = write_report(
        "docker_startup",
        {
            "image": image,
            "isolation": list(first.isolation),
            "stats": stats,
            "ratios_vs_docker_run": {n: st["p50_ms"] / base for n, st in stats.items()},
            "target_ratio": TARGET_RATIO,
            "target_warm_ms": TARGET_WARM_MS,
            "pass": {"ratio": ratio_ok, "warm": warm_ok},
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

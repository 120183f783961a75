"""Shared helpers: interleaved timing, medians, and a JSON report next to the console table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def time_interleaved(
    cases: dict[str, Callable[[], object]], runs: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Milliseconds per call, cases interleaved run by run so machine noise hits all alike."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1000)
    return samples


def summarize(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(samples),
        "p50_ms": statistics.median(samples),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
    }


def write_report(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": name,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "euid": os.geteuid()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path

"""A CLI call does not spawn probe sandboxes again: the next process reads the verdicts
the first one wrote, until something they depend on (here, the bwrap binary) changes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devs_sandbox.isolation import probe_cache

pytestmark = [pytest.mark.integration, pytest.mark.bwrap]

PROBE = (
    "import json; from devs_sandbox.isolation import bwrap; s = bwrap.probe(); "
    "print(json.dumps([s.path, s.works, s.reason]))"
)


def _probe(env: dict[str, str]) -> list[object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return list(json.loads(out.stdout))


def test_the_next_process_reads_the_verdict_until_bwrap_changes(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("bwrap")
    assert real is not None
    bwrap = bin_dir / "bwrap"
    shutil.copy2(real, bwrap)
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        probe_cache.ENV: str(cache),
    }
    first = _probe(env)
    assert first[:2] == [str(bwrap), True]
    # The file is the first process's verdict; plant a different one under the same key to
    # see whether the next process probes or reads.
    path = cache / probe_cache.FILE_NAME
    data = json.loads(path.read_text())
    (name,) = [n for n in data["results"] if n.startswith("bwrap")]
    data["results"][name] = [str(bwrap), False, "read from the cache", ""]
    path.write_text(json.dumps(data))
    assert _probe(env)[1:] == [False, "read from the cache"]
    # A new bwrap binary (another mtime) is probed again.
    os.utime(bwrap, ns=(0, bwrap.stat().st_mtime_ns + 10**9))
    assert _probe(env)[1:] == [True, ""]
    assert _probe({**env, probe_cache.ENV: "0"})[1:] == [True, ""]


def test_doctor_probes_afresh_and_rewrites_the_verdicts(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, probe_cache.ENV: str(cache)}
    _probe(env)
    path = cache / probe_cache.FILE_NAME
    data = json.loads(path.read_text())
    (name,) = [n for n in data["results"] if n.startswith("bwrap")]
    data["results"][name] = [shutil.which("bwrap"), False, "stale", ""]
    path.write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, "-m", "devs_sandbox", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["bwrap"]["works"] is True
    assert json.loads(path.read_text())["results"][name][1:3] == [True, ""]

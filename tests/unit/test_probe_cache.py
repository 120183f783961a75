"""The host probes' verdicts on disk: reused only while the host is the same, and only
from a file and a directory that are ours alone."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devs_sandbox.isolation import probe_cache


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "cache"
    monkeypatch.setenv(probe_cache.ENV, str(d))
    yield d


def _probe(calls: list[int], value: tuple[bool, str]) -> tuple[bool, str]:
    calls.append(1)
    return value


def _cached(calls: list[int], value: tuple[bool, str] = (True, "")) -> tuple[bool, str]:
    return probe_cache.cached(
        "p", lambda: _probe(calls, value), encode=list, decode=lambda v: (v[0], v[1])
    )


def test_a_verdict_is_probed_once_then_read_back(cache_dir: Path) -> None:
    calls: list[int] = []
    assert _cached(calls, (False, "no bwrap")) == (False, "no bwrap")
    assert _cached(calls, (True, "")) == (False, "no bwrap")
    assert len(calls) == 1
    st = (cache_dir / probe_cache.FILE_NAME).stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700


def test_another_host_key_is_probed_again(cache_dir: Path) -> None:
    calls: list[int] = []
    _cached(calls)
    path = cache_dir / probe_cache.FILE_NAME
    data = json.loads(path.read_text())
    data["key"] = "another kernel"
    path.write_text(json.dumps(data))
    _cached(calls)
    assert len(calls) == 2


def test_an_old_verdict_is_probed_again(cache_dir: Path) -> None:
    calls: list[int] = []
    _cached(calls)
    path = cache_dir / probe_cache.FILE_NAME
    data = json.loads(path.read_text())
    data["written_at"] = time.time() - probe_cache.MAX_AGE_S - 1
    path.write_text(json.dumps(data))
    _cached(calls)
    assert len(calls) == 2


@pytest.mark.parametrize("what", ["file writable by others", "directory open to others"])
def test_a_cache_others_could_have_written_is_ignored(cache_dir: Path, what: str) -> None:
    calls: list[int] = []
    _cached(calls, (False, "probed"))
    path = cache_dir / probe_cache.FILE_NAME
    if what.startswith("file"):
        path.chmod(0o666)
    else:
        cache_dir.chmod(0o777)
    assert _cached(calls, (True, "")) == (True, "")
    assert len(calls) == 2


def test_a_symlinked_cache_file_is_ignored(cache_dir: Path, tmp_path: Path) -> None:
    calls: list[int] = []
    _cached(calls, (False, "probed"))
    path = cache_dir / probe_cache.FILE_NAME
    planted = tmp_path / "planted.json"
    planted.write_text(path.read_text())
    planted.chmod(0o600)
    path.unlink()
    path.symlink_to(planted)
    assert _cached(calls, (True, "")) == (True, "")
    assert len(calls) == 2


def test_zero_turns_the_cache_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(probe_cache.ENV, "0")
    monkeypatch.chdir(tmp_path)
    calls: list[int] = []
    _cached(calls)
    _cached(calls)
    assert len(calls) == 2
    assert probe_cache.directory() is None


def test_invalidate_forgets(cache_dir: Path) -> None:
    calls: list[int] = []
    _cached(calls)
    probe_cache.invalidate()
    _cached(calls)
    assert len(calls) == 2

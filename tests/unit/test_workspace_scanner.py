"""The workspace walker: correct counts, bounded ticks, no re-listing of unchanged directories."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from devs_sandbox.workspace import WorkspaceScanner

pytestmark = pytest.mark.unit


def make_tree(root: Path, depth: int, files_per_dir: int = 2) -> None:
    d = root
    for level in range(depth):
        d = d / f"d{level}"
        d.mkdir()
        for i in range(files_per_dir):
            (d / f"f{i}").write_bytes(b"x" * (level + 1))


def settle() -> None:
    # Let directory mtimes age past the racy window so the cache may trust them.
    time.sleep(0.06)


def test_counts_depth_sizes(tmp_path: Path) -> None:
    make_tree(tmp_path, 5)
    (tmp_path / "big").write_bytes(b"y" * 1000)
    r = WorkspaceScanner(tmp_path).scan()
    assert r is not None and r.complete
    assert r.max_depth == 5
    assert r.file_count == 5 + 5 * 2 + 1
    assert r.largest_file_bytes == 1000
    assert r.total_bytes == 1000 + 2 * sum(range(1, 6))


def test_symlinks_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    make_tree(outside, 10)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "link").symlink_to(outside)
    (ws / "loop").symlink_to(ws)
    r = WorkspaceScanner(ws).scan()
    assert r is not None and r.max_depth == 0 and r.file_count == 2


def test_unchanged_directories_are_not_listed_again(tmp_path: Path) -> None:
    make_tree(tmp_path, 20, files_per_dir=5)
    s = WorkspaceScanner(tmp_path)
    first = s.scan()
    assert first is not None and first.dirs_listed == 21
    settle()
    s.scan()  # the first listing may have been racy
    settle()
    again = s.scan()
    assert again is not None and again.dirs_listed == 0
    assert again.max_depth == 20 and again.file_count == first.file_count
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(20)])
    (deep / "new").mkdir()
    changed = s.scan()
    assert changed is not None and changed.max_depth == 21
    assert 1 <= changed.dirs_listed <= 2


def test_a_file_growing_in_place_is_seen_at_the_full_rescan(tmp_path: Path) -> None:
    f = tmp_path / "grow"
    f.write_bytes(b"a")
    s = WorkspaceScanner(tmp_path, full_rescan_every=3)
    s.scan()
    settle()
    with f.open("ab") as fh:
        fh.write(b"b" * 5000)
    sizes = [s.scan().largest_file_bytes for _ in range(4)]  # type: ignore[union-attr]
    assert sizes[-1] == 5001


def test_budget_bounds_a_tick_and_the_walk_resumes(tmp_path: Path) -> None:
    for i in range(30):
        d = tmp_path / f"dir{i}"
        d.mkdir()
        for j in range(300):
            (d / f"f{j}").touch()
    s = WorkspaceScanner(tmp_path, budget_s=0.0)
    ticks = 0
    while True:
        ticks += 1
        r = s.scan()
        assert r is not None
        if r.complete:
            break
        assert r.file_count <= 30 + 30 * 300
    assert ticks > 1
    assert r.file_count == 30 + 30 * 300


def test_huge_directory_is_listed_across_ticks(tmp_path: Path) -> None:
    for j in range(3000):
        (tmp_path / f"f{j}").touch()
    s = WorkspaceScanner(tmp_path, budget_s=0.0)
    partial = s.scan()
    assert partial is not None and not partial.complete and 0 < partial.file_count < 3000
    while not (r := s.scan()).complete:  # type: ignore[union-attr]
        pass
    assert r.file_count == 3000  # type: ignore[union-attr]


def test_removed_directories_leave_the_cache(tmp_path: Path) -> None:
    make_tree(tmp_path, 3)
    s = WorkspaceScanner(tmp_path)
    s.scan()
    import shutil

    shutil.rmtree(tmp_path / "d0")
    r = s.scan()
    assert r is not None and r.max_depth == 0 and r.file_count == 0
    assert list(s._cache) == [str(tmp_path)]


def test_gone_workspace(tmp_path: Path) -> None:
    assert WorkspaceScanner(tmp_path / "missing").scan() is None


def test_unreadable_directory_is_skipped(tmp_path: Path) -> None:
    make_tree(tmp_path, 2)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "x").touch()
    locked.chmod(0)
    try:
        r = WorkspaceScanner(tmp_path).scan()
        assert r is not None and r.complete
    finally:
        os.chmod(locked, 0o700)

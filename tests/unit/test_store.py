"""The SQLite store: schema, migrations, injection-shaped ids, concurrent writers."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from devs_sandbox import store as store_module
from devs_sandbox.errors import StoreError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.models import DetectionRule, Violation, ViolationType
from devs_sandbox.store import COLUMNS, LOCKED_RETRIES, SCHEMA_VERSION, ViolationStore

pytestmark = pytest.mark.unit


def v(
    sandbox_id: str = "sb-1", kind: ViolationType = ViolationType.FILE_COUNT_EXCEEDED
) -> Violation:
    return Violation(sandbox_id, kind, 10_001, 10_000, DetectionRule.GROWTH, "detail")


def test_table_has_the_specified_columns(db_path: Path) -> None:
    with ViolationStore(db_path) as store:
        store.record(v())
        assert store.schema_version() == SCHEMA_VERSION
    conn = sqlite3.connect(db_path)
    cols = [r[1] for r in conn.execute("PRAGMA table_info(sandbox_violations)")]
    pk = [r[1] for r in conn.execute("PRAGMA table_info(sandbox_violations)") if r[5]]
    assert cols[:6] == [
        "violation_id",
        "sandbox_id",
        "violation_type",
        "observed_value",
        "limit_value",
        "terminated_at",
    ]
    assert pk == ["violation_id"]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_record_and_list(db_path: Path) -> None:
    with ViolationStore(db_path) as store:
        first = v("a")
        store.record(first)
        store.record(first)  # same id: ignored
        store.record(v("b", ViolationType.PROCESS_COUNT_EXCEEDED))
        rows = store.list()
        assert store.count() == 2
        assert {r["sandbox_id"] for r in rows} == {"a", "b"}
        assert set(rows[0]) == set(COLUMNS)
        only_a = store.list(sandbox_id="a")
        assert len(only_a) == 1 and only_a[0]["violation_type"] == "FILE_COUNT_EXCEEDED"
        assert only_a[0]["rule"] == "growth"
        assert len(store.list(limit=1)) == 1


def test_list_only_the_given_sandboxes(db_path: Path) -> None:
    """How the MCP server shows a client its own rows: filtered in SQL, any number of ids."""
    with ViolationStore(db_path) as store:
        for sandbox_id in ("a", "b", "c", "b"):
            store.record(v(sandbox_id))
        assert {r["sandbox_id"] for r in store.list(sandbox_ids={"a", "b"})} == {"a", "b"}
        assert len(store.list(sandbox_ids=["b"])) == 2
        assert len(store.list(sandbox_ids=["b"], limit=1)) == 1
        assert store.list(sandbox_ids=[]) == [] and store.list(sandbox_ids=["zz"]) == []
        assert store.list(sandbox_id="c", sandbox_ids=["a", "b"]) == []  # both filters hold
        assert len(store.list(sandbox_id="a", sandbox_ids=["a", "b"])) == 1
        # More ids than SQLite takes as bound parameters, and injection-shaped ones.
        many = [f"sb-{i}" for i in range(40_000)] + ["a", "x') OR 1=1 --"]
        assert [r["sandbox_id"] for r in store.list(sandbox_ids=many)] == ["a"]


def test_injection_shaped_sandbox_id_is_stored_verbatim(db_path: Path) -> None:
    evil = "x'); DROP TABLE sandbox_violations;--"
    with ViolationStore(db_path) as store:
        store.record(v(evil))
        assert store.list(sandbox_id=evil)[0]["sandbox_id"] == evil
        assert store.count() == 1


def test_migrates_a_version_1_database(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute(
        "CREATE TABLE sandbox_violations (violation_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL,"
        " violation_type TEXT NOT NULL, observed_value INTEGER NOT NULL, limit_value INTEGER NOT"
        " NULL, terminated_at TEXT NOT NULL)"
    )
    conn.execute(
        "INSERT INTO sandbox_violations VALUES ('old', 's', 'FILE_COUNT_EXCEEDED', 2, 1, 't')"
    )
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with ViolationStore(db_path) as store:
        rows = store.list()
        assert store.schema_version() == SCHEMA_VERSION
    assert rows[0]["violation_id"] == "old" and rows[0]["rule"] == "threshold"


def test_refuses_a_newer_schema(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer"), ViolationStore(db_path) as store:
        store.count()


def test_unwritable_path_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError):
        ViolationStore(blocker / "sub" / "db").record(v())


def test_attach_records_violation_events_only(db_path: Path) -> None:
    bus = EventBus()
    with ViolationStore(db_path) as store:
        store.attach(bus)
        bus.emit(SandboxEvents.VIOLATION, {"violation": v("z")})
        bus.emit(SandboxEvents.VIOLATION, {"violation": "not a violation"})
        bus.emit(SandboxEvents.TIMEOUT, {"sandbox_id": "z"})
        assert store.count() == 1


def _writer(path: str, worker: int, n: int) -> None:
    store = ViolationStore(path)
    for i in range(n):
        store.record(v(f"w{worker}-{i}"))
    store.close()


def test_concurrent_writers_from_several_processes_lose_nothing(db_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(db_path), w, 60)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with ViolationStore(db_path) as store:
        assert store.count() == 240


def _hold_a_reader_on_a_new_rollback_journal(db_path: Path) -> sqlite3.Connection:
    """A second process that opened the new store first, mid-read: until it is done,
    our switch to WAL (an exclusive lock) meets "database is locked"."""
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE early (x)")
    other.execute("BEGIN")
    other.execute("SELECT * FROM early").fetchall()
    return other


def _opens(
    store: ViolationStore,
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[int], None] = lambda _attempt: None,
) -> list[int]:
    """The store's attempts to open its file, as ``_inserts`` lists its inserts;
    ``before(n)`` runs just before attempt n."""
    attempts: list[int] = []
    real_open = store._open

    def counted_open() -> sqlite3.Connection:
        attempts.append(len(attempts) + 1)
        before(attempts[-1])
        return real_open()

    monkeypatch.setattr(store, "_open", counted_open)
    return attempts


def test_opening_a_new_store_while_another_process_holds_it_is_retried(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.01)
    other = _hold_a_reader_on_a_new_rollback_journal(db_path)
    with ViolationStore(db_path) as store:

        def release_once_the_first_attempt_failed(attempt: int) -> None:
            if attempt == 2:
                other.execute("COMMIT")

        opens = _opens(store, monkeypatch, release_once_the_first_attempt_failed)
        store.record(v("after the lock"))
        assert len(opens) == 2
        assert [r["sandbox_id"] for r in store.list()] == ["after the lock"]
        assert store._connect().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()


def test_a_store_that_stays_locked_at_open_is_one_store_error_not_nested_retries(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.01)
    monkeypatch.setattr(store_module, "LOCKED_FIRST_WAIT_S", 0.001)
    other = _hold_a_reader_on_a_new_rollback_journal(db_path)
    try:
        with ViolationStore(db_path) as store:
            opens = _opens(store, monkeypatch)
            with pytest.raises(StoreError, match=r"cannot open violation store .*locked"):
                store.record(v("never"))
            assert len(opens) == LOCKED_RETRIES + 1
    finally:
        other.close()


def _hold_write_lock(db_path: Path) -> sqlite3.Connection:
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # WAL: the one writer; ours now meets "database is locked"
    return other


def _inserts(store: ViolationStore) -> list[str]:
    seen: list[str] = []
    store._connect().set_trace_callback(
        lambda sql: seen.append(sql) if sql.startswith("INSERT") else None
    )
    return seen


def test_a_lock_that_outlives_the_busy_timeout_is_retried(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.01)
    with ViolationStore(db_path) as store:
        attempts = _inserts(store)
        other = _hold_write_lock(db_path)
        released = threading.Event()

        def release() -> None:
            while len(attempts) < 2 and not released.is_set():  # the first attempt failed
                released.wait(0.01)
            other.execute("COMMIT")

        t = threading.Thread(target=release)
        t.start()
        try:
            store.record(v("retried"))
        finally:
            released.set()
            t.join()
        other.close()
        assert [r["sandbox_id"] for r in store.list()] == ["retried"]
        assert 2 <= len(attempts) <= LOCKED_RETRIES + 1


def test_a_lock_that_never_goes_is_a_store_error_after_the_last_retry(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.01)
    monkeypatch.setattr(store_module, "LOCKED_FIRST_WAIT_S", 0.001)
    with ViolationStore(db_path) as store:
        attempts = _inserts(store)
        other = _hold_write_lock(db_path)
        try:
            with pytest.raises(StoreError, match="locked"):
                store.record(v("lost"))
        finally:
            other.close()
        assert len(attempts) == LOCKED_RETRIES + 1

"""The audit trail: a SQLite file with the ``sandbox_violations`` table of the specification.

Invariants:
- only parameterized SQL touches user data (sandbox ids come from agents);
- several processes may open and write at once and nothing is lost (WAL, a busy timeout,
  and a bounded retry on ``database is locked``);
- the schema carries a version (``PRAGMA user_version``) and migrates forward in
  one ``BEGIN IMMEDIATE`` transaction, so two processes starting together do not
  both migrate;
- the store only listens to the bus (``attach``); nothing reads it back during a run.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from devs_sandbox.errors import StoreError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.models import Violation, violation_row

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Each entry migrates from version i to i + 1. Never edit a shipped entry; append.
MIGRATIONS: Final[Sequence[Sequence[str]]] = (
    (
        """CREATE TABLE sandbox_violations (
            violation_id TEXT PRIMARY KEY,
            sandbox_id TEXT NOT NULL,
            violation_type TEXT NOT NULL,
            observed_value INTEGER NOT NULL,
            limit_value INTEGER NOT NULL,
            terminated_at TEXT NOT NULL
        )""",
    ),
    (
        "ALTER TABLE sandbox_violations ADD COLUMN rule TEXT NOT NULL DEFAULT 'threshold'",
        "ALTER TABLE sandbox_violations ADD COLUMN detail TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX ix_violations_sandbox ON sandbox_violations (sandbox_id, terminated_at)",
    ),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)
COLUMNS: Final = (
    "violation_id",
    "sandbox_id",
    "violation_type",
    "observed_value",
    "limit_value",
    "terminated_at",
    "rule",
    "detail",
)

BUSY_TIMEOUT_S: Final = 10.0  # how long one statement waits for another process's lock
LOCKED_RETRIES: Final = 5  # extra attempts when the lock outlives the busy timeout
LOCKED_FIRST_WAIT_S: Final = 0.05  # then doubling


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def _retry_locked(action: Callable[[], _T]) -> _T:
    """``action()``, tried again up to LOCKED_RETRIES times while SQLite says "locked",
    waiting 0.05, 0.1, 0.2 ... s between attempts; the last failure propagates.

    Not nested: ``record``'s retry sees ``_connect``'s own exhausted retry as a
    StoreError, which it passes on."""
    for attempt in range(LOCKED_RETRIES):
        try:
            return action()
        except sqlite3.OperationalError as exc:
            if not _locked(exc):
                raise
        time.sleep(LOCKED_FIRST_WAIT_S * 2**attempt)
    return action()


class ViolationStore:
    """Records violations; opened lazily so runs without a violation never touch the disk."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._unsubscribe: list[Callable[[], None]] = []

    # -- connection -----------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            try:
                self._conn = _retry_locked(self._open)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open violation store {self.path}: {exc}") from exc
            except OSError as exc:
                raise StoreError(f"cannot create violation store {self.path}: {exc}") from exc
        return self._conn

    def _open(self) -> sqlite3.Connection:
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            str(self.path),
            timeout=BUSY_TIMEOUT_S,
            isolation_level=None,  # explicit transactions only
            check_same_thread=False,  # guarded by self._lock
        )
        try:
            conn.row_factory = sqlite3.Row
            # Switching a new file to WAL takes an exclusive lock without calling the
            # busy handler: a second process opening the same new store at that moment
            # gets "database is locked" at once. _retry_locked covers it.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"violation store has schema version {version}, newer than this "
                f"devs-sandbox understands ({SCHEMA_VERSION}); upgrade devs-sandbox"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step]:
                    conn.execute(statement)
            # PRAGMA cannot take a parameter; SCHEMA_VERSION is our own integer.
            conn.execute(f"PRAGMA user_version = {int(SCHEMA_VERSION)}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def schema_version(self) -> int:
        with self._lock:
            return int(self._connect().execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ViolationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes ---------------------------------------------------------------------
    def record(self, violation: Violation) -> None:
        """Insert one row; a second insert of the same violation id is ignored."""
        row = violation_row(violation)
        # Column names are our constants; every value is a bound parameter.
        sql = (
            f"INSERT OR IGNORE INTO sandbox_violations ({', '.join(COLUMNS)}) "  # noqa: S608
            f"VALUES ({', '.join('?' for _ in COLUMNS)})"
        )
        params = tuple(row[c] for c in COLUMNS)

        def insert() -> None:
            with self._lock:
                self._connect().execute(sql, params)

        try:
            _retry_locked(insert)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record violation in {self.path}: {exc}") from exc

    def attach(self, bus: EventBus) -> None:
        """Subscribe to ``sandbox:violation``; the bus logs (and survives) a failed write."""

        def on_violation(_event: str, payload: dict[str, Any]) -> None:
            violation = payload.get("violation")
            if isinstance(violation, Violation):
                self.record(violation)

        self._unsubscribe.append(bus.on(SandboxEvents.VIOLATION, on_violation))

    # -- reads (CLI, MCP, tests; never during a run) --------------------------------------
    def list(
        self,
        *,
        sandbox_id: str | None = None,
        sandbox_ids: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Rows newest first, as dicts keyed by the column names: all of them, those of
        ``sandbox_id``, and (when given) only those whose sandbox is in ``sandbox_ids``.

        ``sandbox_ids`` is how the MCP server shows a client its own rows only: the server
        knows which sandboxes each client made; the table stays what the bus recorded.
        """
        if sandbox_ids is not None and not sandbox_ids:
            return []
        sql = f"SELECT {', '.join(COLUMNS)} FROM sandbox_violations"  # noqa: S608 - constants
        where: list[str] = []
        params: list[Any] = []
        if sandbox_id is not None:
            where.append("sandbox_id = ?")
            params.append(sandbox_id)
        if sandbox_ids is not None:
            # One bound parameter however many ids (no SQLITE_MAX_VARIABLE_NUMBER to hit).
            where.append("sandbox_id IN (SELECT value FROM json_each(?))")
            params.append(json.dumps(sorted(sandbox_ids)))
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY terminated_at DESC, rowid DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        try:
            with self._lock:
                rows = self._connect().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read violation store {self.path}: {exc}") from exc
        return [dict(r) for r in rows]

    def count(self) -> int:
        try:
            with self._lock:
                row = self._connect().execute("SELECT COUNT(*) FROM sandbox_violations").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read violation store {self.path}: {exc}") from exc
        return int(row[0])

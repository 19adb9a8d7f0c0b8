"""The profile database's file format: identity, tables, migrations and the rows the tables take.

The file identifies itself with ``PRAGMA application_id`` and records its schema version in both
``PRAGMA user_version`` and the ``meta`` table; anything else (not SQLite, another application's
database, a newer schema) raises :class:`ProfileError` instead of yielding numbers. An older file
(version 0 being a new, empty one) is upgraded in place by :func:`migrate`, one step per version.
Rows are validated before they are written: durations finite and positive, counts and sizes
integers in range.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable
from pathlib import Path

from profiler.fingerprint import DeviceFingerprint
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import KernelKey

SCHEMA_VERSION = 2
APPLICATION_ID = int.from_bytes(b"vTrn", "big")  # 0x7654726e

_SQLITE_MAGIC = b"SQLite format 3\x00"
INSERT_KERNEL = ("INSERT OR REPLACE INTO kernels (fingerprint_id, digest, op, key_json, duration_ns, repetitions,"
                 " spread_ns, measured_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
INSERT_COMM = ("INSERT OR REPLACE INTO comm (fingerprint_id, kind, group_size, backend, nbytes, duration_ns,"
               " measured_at) VALUES (?, ?, ?, ?, ?, ?, ?)")


def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute(
        "CREATE TABLE devices (fingerprint_id TEXT PRIMARY KEY, label TEXT NOT NULL,"
        " device_name TEXT NOT NULL, fingerprint_json TEXT NOT NULL)")
    conn.execute(
        "CREATE TABLE kernels (fingerprint_id TEXT NOT NULL, digest TEXT NOT NULL, op TEXT NOT NULL,"
        " key_json TEXT NOT NULL, duration_ns REAL NOT NULL, repetitions INTEGER NOT NULL,"
        " spread_ns REAL NOT NULL, measured_at TEXT NOT NULL,"
        " PRIMARY KEY (fingerprint_id, digest)) WITHOUT ROWID")
    conn.execute(
        "CREATE TABLE comm (fingerprint_id TEXT NOT NULL, kind TEXT NOT NULL, group_size INTEGER NOT NULL,"
        " backend TEXT NOT NULL, nbytes INTEGER NOT NULL, duration_ns REAL NOT NULL,"
        " measured_at TEXT NOT NULL,"
        " PRIMARY KEY (fingerprint_id, kind, group_size, backend, nbytes)) WITHOUT ROWID")


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    """Collective kinds are CollectiveKind values: the point-to-point benchmark is ``send``."""
    conn.execute("UPDATE comm SET kind = 'send' WHERE kind = 'send_recv'")


# _MIGRATIONS[v] upgrades a file at schema version v to v + 1; version 0 is a new, empty file.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_0_to_1, _migrate_1_to_2)
assert len(_MIGRATIONS) == SCHEMA_VERSION


# ---- identity and migration ------------------------------------------------------------------------

def check_header(path: Path) -> None:
    """Raise unless ``path`` is absent, empty or starts with the SQLite header (checked before connecting)."""
    if path.is_dir():
        raise ProfileError(f"profile database {path} is a directory, not a file")
    try:
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ProfileError(f"profile database {path}: cannot read: {exc}") from None
    if head and head != _SQLITE_MAGIC:
        raise ProfileError(f"profile database {path} is not a SQLite file (bad header)")


def read_identity(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """``(application_id, user_version, number of schema objects)`` of the open file."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    objects = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    return app_id, version, objects


def check_identity(path: Path, app_id: int, version: int, objects: int) -> None:
    """Raise unless the file is new and empty or a vtrain profile of a schema this code reads."""
    if app_id == 0 and objects == 0:
        return  # a new, empty file: version 0
    if app_id != APPLICATION_ID:
        raise ProfileError(
            f"profile database {path} belongs to another application (application_id "
            f"{app_id:#x}, vtrain uses {APPLICATION_ID:#x})")
    if version > SCHEMA_VERSION:
        raise ProfileError(
            f"profile database {path} has schema_version {version}, newer than this vtrain "
            f"reads ({SCHEMA_VERSION}); upgrade vtrain or use another file")


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Upgrade the file to :data:`SCHEMA_VERSION`; run inside a write transaction."""
    app_id, version, objects = read_identity(conn)  # again, under the write lock
    check_identity(path, app_id, version, objects)
    for step in _MIGRATIONS[version:]:
        step(conn)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                 (str(SCHEMA_VERSION),))


# ---- rows ------------------------------------------------------------------------------------------

def insert_device(conn: sqlite3.Connection, fp: DeviceFingerprint) -> None:
    conn.execute("INSERT OR IGNORE INTO devices (fingerprint_id, label, device_name, fingerprint_json)"
                 " VALUES (?, ?, ?, ?)",
                 (fp.id, fp.label, fp.device_name, json.dumps(fp.to_dict(), sort_keys=True)))


def kernel_row(fid: str, key: KernelKey, duration_ns: float, repetitions: int, spread_ns: float,
               measured_at: str, *, where: str) -> tuple:
    """The validated :data:`INSERT_KERNEL` parameters; ``where`` starts the error messages."""
    _check_duration(duration_ns, f"{where}: kernel {key.op} duration_ns")
    _check_number(spread_ns, f"{where}: kernel {key.op} spread_ns", minimum=0.0)
    if not isinstance(repetitions, int) or repetitions < 1:
        raise ProfileError(f"{where}: kernel {key.op} repetitions ({repetitions!r}) must be an integer >= 1")
    key_json = json.dumps(key.to_dict(), sort_keys=True, separators=(",", ":"))
    return (fid, key.digest, key.op, key_json, float(duration_ns), repetitions, float(spread_ns), measured_at)


def comm_row(fid: str, kind: str, group_size: int, backend: str, nbytes: int, duration_ns: float,
             measured_at: str, *, where: str) -> tuple:
    """The validated :data:`INSERT_COMM` parameters; ``where`` starts the error messages."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ProfileError(f"{where}: {kind} group_size ({group_size!r}) must be an integer >= 1")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ProfileError(f"{where}: {kind} nbytes ({nbytes!r}) must be an integer >= 0")
    _check_duration(duration_ns, f"{where}: {kind} of {nbytes} bytes duration_ns")
    return (fid, kind, group_size, backend, nbytes, float(duration_ns), measured_at)


def _check_duration(value: object, what: str) -> None:
    _check_number(value, what, minimum=0.0)
    if value == 0:
        raise ProfileError(f"{what} ({value!r}) must be > 0")


def _check_number(value: object, what: str, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise ProfileError(f"{what} ({value!r}) must be a finite number >= {minimum:g}")

"""The profile database: measured kernel and collective durations per device, in one SQLite file.

A row is keyed by the :class:`~profiler.fingerprint.DeviceFingerprint` id of the device it was
measured on, so a profile taken on an H100 is never returned for a CPU (or an A100) unless the
caller asks for the H100's fingerprint explicitly (see :meth:`ProfileDB.find_fingerprints`).

The file format (identity, tables, migrations, row validation) is :mod:`profiler.db_schema`; a
file that is not a vtrain profile of a schema this code reads (not SQLite, corrupt, another
application's database, a newer schema) raises :class:`ProfileError` instead of yielding numbers.
Writers use WAL mode, a busy timeout and short ``BEGIN IMMEDIATE`` transactions retried while the
file is locked, so several profiling processes can fill one file at once.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from profiler.db_schema import (INSERT_COMM, INSERT_KERNEL, SCHEMA_VERSION, check_header, check_identity, comm_row,
                                insert_device, kernel_row, migrate, read_identity)
from profiler.fingerprint import DeviceFingerprint
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.files import atomic_write_text, user_cache_dir
from vtrain_plugin.core.graph import CollectiveKind, KernelKey

EXPORT_FORMAT = "vtrain-profile"
EXPORT_VERSION = 1
ENV_VAR = "VTRAIN_PROFILE_DB"

_LOCK_TIMEOUT_S = 60.0
_BATCH = 500  # bound parameters per IN (...) query

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportCounts:
    devices: int
    kernels: int
    comm: int


def default_db_path() -> Path:
    """``$VTRAIN_PROFILE_DB``, else ``$XDG_CACHE_HOME/vtrain/profiles.sqlite``, else ``~/.cache/...``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return user_cache_dir() / "profiles.sqlite"


class ProfileDB:
    """Measured durations keyed by device fingerprint. Open with :meth:`open`; use as a context manager."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    # ---- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike | None = None) -> ProfileDB:
        """Open (creating or migrating as needed) the database at ``path`` or :func:`default_db_path`."""
        resolved = Path(path).expanduser() if path is not None else default_db_path()
        check_header(resolved)
        try:
            resolved.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(resolved, timeout=_LOCK_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise ProfileError(f"profile database {resolved}: cannot open: {exc}") from None
        db = cls(resolved, conn)
        try:
            db._prepare()
        except BaseException:
            conn.close()
            raise
        return db

    def _prepare(self) -> None:
        app_id, version, objects = self._retry(lambda: read_identity(self._conn))
        check_identity(self.path, app_id, version, objects)
        if version < SCHEMA_VERSION:
            self._transaction(lambda conn: migrate(conn, self.path))
        mode = self._retry(lambda: self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0])
        if str(mode).lower() != "wal":
            raise ProfileError(f"profile database {self.path}: cannot switch to WAL journal mode (got {mode})")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        rows = self._read("SELECT value FROM meta WHERE key = 'schema_version'")
        if rows != [(str(SCHEMA_VERSION),)]:
            raise ProfileError(
                f"profile database {self.path}: meta schema_version {rows[0][0] if rows else None!r} "
                f"disagrees with user_version {SCHEMA_VERSION}")

    # ---- kernels -------------------------------------------------------------------------------

    def put_kernel(self, fp: DeviceFingerprint, key: KernelKey, duration_ns: float, repetitions: int,
                   spread_ns: float) -> None:
        """Store (replacing) the median ``duration_ns`` of ``key`` on ``fp``; ``spread_ns`` is the IQR."""
        row = kernel_row(fp.id, key, duration_ns, repetitions, spread_ns, _now(), where=str(self.path))

        def body(conn: sqlite3.Connection) -> None:
            insert_device(conn, fp)
            conn.execute(INSERT_KERNEL, row)

        self._transaction(body)

    def get_kernel(self, fp: DeviceFingerprint, key: KernelKey) -> float | None:
        """Median duration in ns of ``key`` measured on ``fp``, or None when it was never measured."""
        rows = self._read("SELECT duration_ns FROM kernels WHERE fingerprint_id = ? AND digest = ?",
                          (fp.id, key.digest))
        return rows[0][0] if rows else None

    def get_kernels(self, fp: DeviceFingerprint, keys: Iterable[KernelKey]) -> dict[KernelKey, float]:
        """Durations of those ``keys`` measured on ``fp`` (unmeasured keys are absent), in few queries."""
        by_digest = {k.digest: k for k in keys}
        digests = list(by_digest)
        found: dict[KernelKey, float] = {}
        for i in range(0, len(digests), _BATCH):
            chunk = digests[i:i + _BATCH]
            marks = ",".join("?" * len(chunk))
            for digest, duration_ns in self._read(
                    f"SELECT digest, duration_ns FROM kernels WHERE fingerprint_id = ? AND digest IN ({marks})",
                    (fp.id, *chunk)):
                found[by_digest[digest]] = duration_ns
        return found

    def has_kernel(self, fp: DeviceFingerprint, key: KernelKey) -> bool:
        return self.get_kernel(fp, key) is not None

    # ---- collectives ---------------------------------------------------------------------------

    def put_comm(self, fp: DeviceFingerprint, kind: CollectiveKind, group_size: int, backend: str, nbytes: int,
                 duration_ns: float) -> None:
        """Store (replacing) the duration of one collective ``kind`` of ``nbytes`` over ``group_size`` ranks."""
        row = comm_row(fp.id, str(kind), group_size, str(backend), nbytes, duration_ns, _now(),
                       where=str(self.path))

        def body(conn: sqlite3.Connection) -> None:
            insert_device(conn, fp)
            conn.execute(INSERT_COMM, row)

        self._transaction(body)

    def comm_table(self, fp: DeviceFingerprint, kind: CollectiveKind, group_size: int,
                   backend: str) -> list[tuple[int, float]]:
        """``(nbytes, duration_ns)`` rows of one collective on ``fp``, sorted by size."""
        return self._read(
            "SELECT nbytes, duration_ns FROM comm WHERE fingerprint_id = ? AND kind = ? AND group_size = ?"
            " AND backend = ? ORDER BY nbytes", (fp.id, str(kind), group_size, str(backend)))

    # ---- devices -------------------------------------------------------------------------------

    def fingerprints(self) -> list[DeviceFingerprint]:
        """Every device this file holds measurements for."""
        return [DeviceFingerprint.from_dict(json.loads(text))
                for (text,) in self._read("SELECT fingerprint_json FROM devices ORDER BY label")]

    def find_fingerprints(self, *, device_name: str | None = None,
                          kind: str | None = None) -> list[DeviceFingerprint]:
        """Devices whose name contains ``device_name`` (case-insensitive) and whose kind is ``kind``.

        This is how a machine without the target device picks a profile measured elsewhere, e.g.
        ``find_fingerprints(device_name="H100")`` on a CPU-only laptop.
        """
        needle = (device_name or "").casefold()
        return [fp for fp in self.fingerprints()
                if needle in fp.device_name.casefold() and (kind is None or fp.kind == kind)]

    # ---- portable JSON -------------------------------------------------------------------------

    def export(self, path: str | os.PathLike,
               fingerprints: Sequence[DeviceFingerprint] | None = None) -> None:
        """Write the rows of ``fingerprints`` (default: all) to a portable JSON file, atomically."""
        devices = self.fingerprints() if fingerprints is None else list(fingerprints)
        ids = [fp.id for fp in devices]
        kernels: list[dict[str, Any]] = []
        comm: list[dict[str, Any]] = []
        for fid in ids:
            for key_json, duration_ns, reps, spread_ns, measured_at in self._read(
                    "SELECT key_json, duration_ns, repetitions, spread_ns, measured_at FROM kernels"
                    " WHERE fingerprint_id = ? ORDER BY digest", (fid,)):
                kernels.append({"fingerprint_id": fid, "key": json.loads(key_json), "duration_ns": duration_ns,
                                "repetitions": reps, "spread_ns": spread_ns, "measured_at": measured_at})
            for kind, group_size, backend, nbytes, duration_ns, measured_at in self._read(
                    "SELECT kind, group_size, backend, nbytes, duration_ns, measured_at FROM comm"
                    " WHERE fingerprint_id = ? ORDER BY kind, group_size, backend, nbytes", (fid,)):
                comm.append({"fingerprint_id": fid, "kind": kind, "group_size": group_size, "backend": backend,
                             "nbytes": nbytes, "duration_ns": duration_ns, "measured_at": measured_at})
        doc = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "devices": [{"id": fp.id, "label": fp.label, "fingerprint": fp.to_dict()} for fp in devices],
            "kernels": kernels,
            "comm": comm,
        }
        atomic_write_text(Path(path), json.dumps(doc, indent=1))

    def import_(self, path: str | os.PathLike) -> ImportCounts:
        """Merge a file written by :meth:`export`; its rows replace rows with the same key here."""
        where = str(path)
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"profile export {where}: cannot read: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
            raise ProfileError(f"profile export {where}: 'format' must be {EXPORT_FORMAT!r}")
        if doc.get("version") != EXPORT_VERSION:
            raise ProfileError(
                f"profile export {where}: version {doc.get('version')!r} is not supported (this vtrain reads "
                f"{EXPORT_VERSION})")
        try:
            devices: dict[str, DeviceFingerprint] = {}
            for d in doc["devices"]:
                fp = DeviceFingerprint.from_dict(d["fingerprint"])
                if fp.id != d["id"]:
                    raise ProfileError(
                        f"profile export {where}: device id {d['id']!r} does not match its fingerprint ({fp.id})")
                devices[fp.id] = fp
            kernel_rows = [
                kernel_row(_known(devices, r["fingerprint_id"], where), KernelKey.from_dict(r["key"]),
                           r["duration_ns"], r["repetitions"], r["spread_ns"], str(r["measured_at"]), where=where)
                for r in doc["kernels"]]
            comm_rows = [
                comm_row(_known(devices, r["fingerprint_id"], where), str(r["kind"]), r["group_size"],
                         str(r["backend"]), r["nbytes"], r["duration_ns"], str(r["measured_at"]), where=where)
                for r in doc["comm"]]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProfileError(f"profile export {where}: malformed entry ({exc!r})") from None

        def body(conn: sqlite3.Connection) -> None:
            for fp in devices.values():
                insert_device(conn, fp)
            conn.executemany(INSERT_KERNEL, kernel_rows)
            conn.executemany(INSERT_COMM, comm_rows)

        self._transaction(body)
        return ImportCounts(devices=len(devices), kernels=len(kernel_rows), comm=len(comm_rows))

    # ---- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ProfileDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._retry(lambda: self._conn.execute(sql, params).fetchall())

    def _transaction(self, body: Callable[[sqlite3.Connection], T]) -> T:
        def attempt() -> T:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = body(self._conn)
                self._conn.execute("COMMIT")
                return result
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

        return self._retry(attempt)

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying while the file is locked by another writer; SQLite errors become ProfileError."""
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        delay_s = 0.002
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                text = str(exc)
                if ("locked" in text or "busy" in text) and time.monotonic() < deadline:
                    time.sleep(delay_s)
                    delay_s = min(2 * delay_s, 0.1)
                    continue
                raise ProfileError(f"profile database {self.path}: {text}") from None
            except sqlite3.DatabaseError as exc:
                raise ProfileError(f"profile database {self.path} is corrupt or unreadable: {exc}") from None


def _known(devices: dict[str, DeviceFingerprint], fid: object, where: str) -> str:
    if fid not in devices:
        raise ProfileError(f"profile export {where}: row refers to unknown device id {fid!r}")
    return str(fid)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

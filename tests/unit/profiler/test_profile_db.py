import json
import multiprocessing
import os
import sqlite3

import pytest

from profiler.db import ProfileDB, default_db_path
from profiler.db_schema import APPLICATION_ID, SCHEMA_VERSION
from profiler.fingerprint import DeviceFingerprint, DeviceKind, current_fingerprint
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import KernelKey

FP_A = DeviceFingerprint(kind=DeviceKind.CUDA, device_name="NVIDIA H100 80GB HBM3", sm_count_or_cores=132,
                         cpu_model="AMD EPYC 9654", torch_version="2.13.0", cuda_version="12.8")
FP_B = DeviceFingerprint(kind=DeviceKind.CPU, device_name="Intel Xeon", sm_count_or_cores=16,
                         cpu_model="Intel Xeon", torch_version="2.13.0")


def mm_key(m: int) -> KernelKey:
    return KernelKey(op="aten.mm.default", input_shapes=((m, 32), (32, 16)), dtypes=("float32", "float32"))


def test_put_get_round_trip(tmp_path):
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        assert db.get_kernel(FP_A, mm_key(8)) is None
        db.put_kernel(FP_A, mm_key(8), 1234.5, 20, 10.0)
        assert db.get_kernel(FP_A, mm_key(8)) == 1234.5
        assert db.has_kernel(FP_A, mm_key(8))
        db.put_kernel(FP_A, mm_key(8), 999.0, 20, 10.0)  # replaces
    with ProfileDB.open(tmp_path / "p.sqlite") as db:  # persisted
        assert db.get_kernel(FP_A, mm_key(8)) == 999.0
        assert db.fingerprints() == [FP_A]


def test_batched_get_returns_only_measured(tmp_path):
    keys = [mm_key(m) for m in range(1, 1201)]
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        for k in keys[::2]:
            db.put_kernel(FP_A, k, float(k.input_shapes[0][0]), 5, 0.0)
        got = db.get_kernels(FP_A, keys)
    assert len(got) == 600
    assert all(got[k] == k.input_shapes[0][0] for k in keys[::2])


def test_rows_are_per_fingerprint(tmp_path):
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        db.put_kernel(FP_A, mm_key(8), 100.0, 5, 1.0)
        db.put_comm(FP_A, "all_reduce", 8, "nccl", 1024, 5000.0)
        assert db.get_kernel(FP_B, mm_key(8)) is None
        assert db.get_kernels(FP_B, [mm_key(8)]) == {}
        assert db.comm_table(FP_B, "all_reduce", 8, "nccl") == []
        assert db.find_fingerprints(device_name="h100") == [FP_A]
        assert db.find_fingerprints(device_name="h100", kind="cpu") == []


def test_comm_table_sorted_by_size(tmp_path):
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        for nbytes in (4096, 1024, 2048):
            db.put_comm(FP_A, "all_gather", 4, "nccl", nbytes, nbytes * 2.0)
        assert db.comm_table(FP_A, "all_gather", 4, "nccl") == [(1024, 2048.0), (2048, 4096.0), (4096, 8192.0)]
        assert db.comm_table(FP_A, "all_gather", 2, "nccl") == []


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0, float("inf")])
def test_invalid_durations_are_rejected(tmp_path, bad):
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        with pytest.raises(ProfileError, match="duration_ns"):
            db.put_kernel(FP_A, mm_key(8), bad, 5, 0.0)
        with pytest.raises(ProfileError, match="duration_ns"):
            db.put_comm(FP_A, "all_reduce", 2, "gloo", 1024, bad)


def _writer(path: str, offset: int, n: int) -> None:
    with ProfileDB.open(path) as db:
        for i in range(offset, offset + n):
            db.put_kernel(FP_A, mm_key(i + 1), float(i + 1), 5, 0.0)


def test_concurrent_writers_lose_no_rows(tmp_path):
    path = str(tmp_path / "p.sqlite")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, off, 500)) for off in (0, 500)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with ProfileDB.open(path) as db:
        got = db.get_kernels(FP_A, [mm_key(i + 1) for i in range(1000)])
    assert len(got) == 1000
    assert sorted(got.values()) == [float(i + 1) for i in range(1000)]


def test_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "p.sqlite"
    ProfileDB.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ProfileError, match=rf"{path}.*schema_version {SCHEMA_VERSION + 1}.*newer"):
        ProfileDB.open(path)


def test_random_bytes_are_refused(tmp_path):
    path = tmp_path / "p.sqlite"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ProfileError, match=rf"{path} is not a SQLite file"):
        ProfileDB.open(path)


def test_corrupt_sqlite_body_is_refused(tmp_path):
    path = tmp_path / "p.sqlite"
    with ProfileDB.open(path) as db:
        db.put_kernel(FP_A, mm_key(8), 100.0, 5, 1.0)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    data[100:] = os.urandom(len(data) - 100)  # keep the 100-byte header, destroy every page
    path.write_bytes(bytes(data))
    with pytest.raises(ProfileError, match=str(path)), ProfileDB.open(path) as db:
        db.get_kernel(FP_A, mm_key(8))


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(ProfileError, match=rf"{path} belongs to another application"):
        ProfileDB.open(path)


def test_plain_sqlite_file_with_tables_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE kernels (x)")
    conn.commit()
    conn.close()
    with pytest.raises(ProfileError, match="another application"):
        ProfileDB.open(path)


def test_new_file_is_stamped(tmp_path):
    path = tmp_path / "sub" / "p.sqlite"
    ProfileDB.open(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    conn.close()


def test_empty_file_is_initialized(tmp_path):
    path = tmp_path / "p.sqlite"
    path.touch()
    with ProfileDB.open(path) as db:
        db.put_kernel(FP_A, mm_key(8), 100.0, 5, 1.0)
        assert db.get_kernel(FP_A, mm_key(8)) == 100.0


def test_export_import_round_trip(tmp_path):
    key = KernelKey(op="aten.native_layer_norm.default", input_shapes=((4, 8), (8,), (8,)),
                    dtypes=("float16", "float16", "float16"), args=(("normalized_shape", (8,)), ("eps", 1e-5)))
    with ProfileDB.open(tmp_path / "a.sqlite") as db:
        db.put_kernel(FP_A, key, 321.0, 7, 2.5)
        db.put_kernel(FP_B, mm_key(4), 50.0, 9, 0.5)
        db.put_comm(FP_A, "all_reduce", 8, "nccl", 1 << 20, 40_000.0)
        db.export(tmp_path / "out" / "profile.json")
    doc = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert doc["format"] == "vtrain-profile" and doc["version"] == 1
    with ProfileDB.open(tmp_path / "b.sqlite") as db:
        counts = db.import_(tmp_path / "out" / "profile.json")
        assert (counts.devices, counts.kernels, counts.comm) == (2, 2, 1)
        assert db.get_kernel(FP_A, key) == 321.0
        assert db.get_kernel(FP_B, mm_key(4)) == 50.0
        assert db.get_kernel(FP_B, key) is None
        assert db.comm_table(FP_A, "all_reduce", 8, "nccl") == [(1 << 20, 40_000.0)]
        assert set(db.fingerprints()) == {FP_A, FP_B}


def test_import_rejects_tampered_export(tmp_path):
    with ProfileDB.open(tmp_path / "a.sqlite") as db:
        db.put_kernel(FP_A, mm_key(4), 50.0, 9, 0.5)
        db.export(tmp_path / "profile.json")
    doc = json.loads((tmp_path / "profile.json").read_text())
    doc["devices"][0]["fingerprint"]["sm_count_or_cores"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    (tmp_path / "v9.json").write_text(json.dumps({"format": "vtrain-profile", "version": 9}))
    with ProfileDB.open(tmp_path / "b.sqlite") as db:
        with pytest.raises(ProfileError, match="does not match its fingerprint"):
            db.import_(tmp_path / "bad.json")
        with pytest.raises(ProfileError, match="version 9"):
            db.import_(tmp_path / "v9.json")
        assert db.fingerprints() == []


def test_default_path_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("VTRAIN_PROFILE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "vtrain" / "profiles.sqlite"
    monkeypatch.setenv("VTRAIN_PROFILE_DB", str(tmp_path / "env.sqlite"))
    assert default_db_path() == tmp_path / "env.sqlite"
    with ProfileDB.open() as db:
        assert db.path == tmp_path / "env.sqlite"
    with ProfileDB.open(tmp_path / "arg.sqlite") as db:
        assert db.path == tmp_path / "arg.sqlite"


def test_fingerprint_is_stable_and_serializable():
    fp = current_fingerprint("cpu")
    assert fp.kind is DeviceKind.CPU and fp.sm_count_or_cores >= 1
    assert DeviceFingerprint.from_dict(fp.to_dict()) == fp
    assert fp.id == current_fingerprint("cpu").id and len(fp.id) == 16
    assert FP_A.id != FP_B.id
    assert "H100" in FP_A.label
    with pytest.raises(ProfileError, match="'tpu'"):
        current_fingerprint("tpu")

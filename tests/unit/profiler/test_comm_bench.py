import pytest

from profiler.comm_bench import BENCHMARKED, benchmark_collectives, group_sizes_for, message_sizes
from vtrain_plugin.core.graph import CollectiveKind
from profiler.db import ProfileDB
from profiler.fingerprint import current_fingerprint
from vtrain_plugin.core.errors import ProfileError


def test_message_sizes_are_powers_of_two():
    assert message_sizes(1024, 64 * 1024) == [1024 << i for i in range(7)]
    assert message_sizes()[0] == 1 << 10 and message_sizes()[-1] == 1 << 30
    assert message_sizes(1000, 4096) == [1024, 2048, 4096]
    with pytest.raises(ProfileError, match="min_nbytes"):
        message_sizes(4096, 1024)


def test_group_sizes():
    assert group_sizes_for(2) == [2]
    assert group_sizes_for(8) == [2, 4, 8]
    assert group_sizes_for(6) == [2, 4, 6]


def test_gloo_benchmark_on_cpu_writes_rows(tmp_path):
    fp = current_fingerprint("cpu")
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        result = benchmark_collectives("cpu", world_size=2, max_nbytes=64 * 1024, db=db, fingerprint=fp)
        sizes = [1024 << i for i in range(7)]
        all_reduce = [r for r in result.rows if r.kind is CollectiveKind.ALL_REDUCE]
        assert [r.nbytes for r in all_reduce] == sizes
        assert all(r.group_size == 2 and r.backend == "gloo" and r.duration_ns > 0 for r in result.rows)
        assert {r.kind for r in result.rows} | {u.kind for u in result.unsupported} == set(BENCHMARKED)
        table = db.comm_table(fp, "all_reduce", 2, "gloo")
        assert [n for n, _ in table] == sizes
        assert [d for _, d in table] == [r.duration_ns for r in all_reduce]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 1}, r"world_size \(1\) must be >= 2"),
    ({"kinds": ["broadcast"]}, "must be among"),
])
def test_invalid_requests_raise_before_spawning(kwargs, match):
    with pytest.raises(ProfileError, match=match):
        benchmark_collectives("cpu", max_nbytes=1024, **kwargs)

"""The task-graph disk cache: a graph read back is the built one, array by array and dtype by dtype.

Why: plans of one schedule shape in every search worker and run share one build (~0.2 s at pp 105),
so a read must give exactly what a build gives, and a damaged entry must be rebuilt, never used.
"""

import numpy as np
import pytest

from vtrain_plugin.sim import task_graph as tg
from vtrain_plugin.specs.training import ScheduleKind

SHAPES = [(ScheduleKind.ONE_F_ONE_B, 16, 1, 256, None), (ScheduleKind.INTERLEAVED_1F1B, 8, 3, 96, None),
          (ScheduleKind.INTERLEAVED_1F1B, 8, 2, 128, 12), (ScheduleKind.GPIPE, 4, 1, 512, None)]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VTRAIN_NO_CACHE", raising=False)
    tg.task_graph.cache_clear()
    yield tmp_path
    tg.task_graph.cache_clear()


def _entries(folder):
    return sorted((folder / "task_graphs").glob(f"*{tg.SUFFIX}"))


def assert_same_graph(read: tg.TaskGraph, built: tg.TaskGraph) -> None:
    for name in tg.TaskGraph.__slots__:
        a, b = getattr(read, name), getattr(built, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        else:
            assert type(a) is type(b) and a == b, name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0].value}-pp{s[1]}-v{s[2]}-m{s[3]}-g{s[4]}")
def test_a_read_graph_is_the_built_graph(cache_dir, shape):
    built = tg.build_task_graph(*shape)
    first = tg.task_graph(*shape)  # built and stored
    assert len(_entries(cache_dir)) == 1
    assert_same_graph(first, built)
    tg.task_graph.cache_clear()
    read = tg.task_graph(*shape)
    assert read is not first
    assert_same_graph(read, built)


def test_small_graphs_are_built_not_stored(cache_dir):
    tg.task_graph(ScheduleKind.ONE_F_ONE_B, 4, 1, 32)  # 256 tasks: a read would cost about what a build does
    assert _entries(cache_dir) == []


def test_no_cache_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")
    tg.task_graph(*SHAPES[0])
    assert _entries(cache_dir) == []


@pytest.mark.parametrize("damage", ["truncated", "not zlib", "no header", "foreign", "wrong lengths"])
def test_a_damaged_or_foreign_entry_is_ignored_and_rebuilt(cache_dir, damage):
    shape = SHAPES[0]
    built = tg.build_task_graph(*shape)
    tg.task_graph(*shape)
    (path,) = _entries(cache_dir)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "not zlib":
        header, _, _ = path.read_bytes().partition(b"\n")
        path.write_bytes(header + b"\nnot a zlib stream")
    elif damage == "no header":
        path.write_bytes(b"\x00\xff" * 100)
    elif damage == "foreign":  # another shape's entry at this path (a hash collision, another code version)
        other = (ScheduleKind.ONE_F_ONE_B, 16, 1, 257, None)
        tg._store(path, (other[0].value, *other[1:]), tg.build_task_graph(*other))
    else:
        header, _, payload = path.read_bytes().partition(b"\n")
        path.write_bytes(header.replace(b'"lengths": [', b'"lengths": [1, ') + b"\n" + payload)
    assert tg._read(path, (shape[0].value, *shape[1:])) is None
    tg.task_graph.cache_clear()
    assert_same_graph(tg.task_graph(*shape), built)
    tg.task_graph.cache_clear()
    assert_same_graph(tg._read(path, (shape[0].value, *shape[1:])), built)  # overwritten with a good entry

"""Tracing leaves the objects made before it out of the garbage collector's walks, and gives them back."""

import gc

import pytest

from vtrain_plugin.capture import child_trace


@pytest.fixture
def unfrozen():
    """The process with nothing frozen (a test runner may freeze its imports), frozen again after."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    if was_frozen:
        gc.freeze()


def _trace_recording_the_freeze(monkeypatch) -> list[int]:
    seen: list[int] = []
    import vtrain_plugin.capture.megatron_chunk as megatron_chunk

    monkeypatch.setattr(megatron_chunk, "trace_chunk", lambda *args: seen.append(gc.get_freeze_count()))
    child_trace._trace_here(None, None, [(True, True, 1), (False, False, 2)])
    return seen


def test_objects_older_than_the_traces_are_frozen_while_they_run_and_then_given_back(unfrozen, monkeypatch):
    older = [[] for _ in range(10)]  # tracked objects made before the traces
    during = _trace_recording_the_freeze(monkeypatch)
    assert len(during) == 2 and all(count >= len(older) for count in during)
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_exactly_those(unfrozen, monkeypatch):
    monkeypatch.setattr(child_trace, "_own_process", False)
    gc.freeze()
    frozen = gc.get_freeze_count()
    during = _trace_recording_the_freeze(monkeypatch)
    assert during == [frozen, frozen]
    assert gc.get_freeze_count() == frozen
    gc.unfreeze()


def test_a_search_worker_keeps_the_objects_older_than_each_trace_frozen(unfrozen, monkeypatch):
    # a worker froze its parent's objects when it started; each trace also freezes the worker's own
    # (earlier traces it keeps), and nothing is given back
    monkeypatch.setattr(child_trace, "_own_process", False)
    child_trace.own_this_process()
    gc.freeze()
    frozen = gc.get_freeze_count()
    kept = [[] for _ in range(10)]  # made by the worker after it started
    during = _trace_recording_the_freeze(monkeypatch)
    assert all(count >= frozen + len(kept) for count in during)
    assert gc.get_freeze_count() >= frozen + len(kept)
    gc.unfreeze()

"""Search workers forked from the caller: the rows of fresh interpreters, and killed on an error or Ctrl-C."""

import os
import threading
import time
from pathlib import Path

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.evaluate import evaluate_batch, make_batches
from vtrain_plugin.planning.progress import ProgressBar
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.planning.workers import WorkerPool, evaluate_in_workers, fork_unsafe
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

MODEL = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
# 2 TP x 2 PP x 2 micro-batch sizes: 8 trace shapes, so 8 batches for two workers
SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1, 2),
                    sequence_parallel=(False,), recompute=("none",))


def _batches():
    enumeration = enumerate_plans(MODEL, SPACE, global_batch_size=8, budget=GpuBudget.parse("2,4"),
                                  training=TrainingSpec(global_batch_size=8), gpus_per_node=8)
    return make_batches(MODEL, get_cluster_preset("dgx-a100"), enumeration.candidates)


def _children() -> list[int]:
    return [int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()]


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return None


def _run(item: tuple[str, object]) -> int:
    kind, value = item
    if kind == "fail":
        raise ConfigError(value)
    time.sleep(value)
    return os.getpid()


def test_forked_workers_give_the_rows_of_fresh_interpreters():
    assert fork_unsafe() is None  # the test process: Linux, one thread
    batches = _batches()
    assert len(batches) == 8
    in_process = [row for batch in batches for row in evaluate_batch(batch)]
    by_start = {}
    for fresh in (False, True):
        before = set(_children())
        with WorkerPool(2, fresh=fresh) as pool:
            pool.start()
            workers = set(_children()) - before
            forked = {_cmdline(pid) for pid in workers} == {_cmdline(os.getpid())}  # a fork runs this command line
            assert len(workers) == 2 and forked is not fresh
            by_start[fresh] = evaluate_in_workers(batches, 2, lambda n: None, pool=pool)
            assert sorted(pool.map(os.getpgid, [0, 0])) == sorted(workers)  # each in a process group of its own
    assert by_start[False] == by_start[True]
    assert sorted(by_start[False], key=lambda item: item[0]) == sorted(in_process, key=lambda item: item[0])


@pytest.mark.parametrize("stop", ["error", "ctrl-c"])
def test_an_error_or_ctrl_c_kills_the_forked_workers(stop):
    """A worker's error, or KeyboardInterrupt in the caller, while the other worker is ten minutes
    into its item: both workers are gone when the exception reaches the caller."""
    def ctrl_c(item):
        raise KeyboardInterrupt

    first = ("fail", "bad input") if stop == "error" else ("sleep", 0.0)
    before = set(_children())
    with pytest.raises(ConfigError if stop == "error" else KeyboardInterrupt):
        with WorkerPool(2) as pool:
            pool.start()
            workers = set(_children()) - before
            assert len(workers) == 2 and {_cmdline(pid) for pid in workers} == {_cmdline(os.getpid())}
            pool.map(_run, [first, ("sleep", 600.0)], on_done=ctrl_c)
    assert [pid for pid in workers if _cmdline(pid) is not None] == []  # killed and reaped


def test_a_running_thread_rules_out_fork():
    done = threading.Event()
    thread = threading.Thread(target=done.wait)
    running = threading.active_count()
    thread.start()
    try:
        assert fork_unsafe() == f"{running + 1} threads running"
        before = set(_children())
        with WorkerPool(1) as pool:
            (pid,) = pool.map(os.getpgid, [0])  # its own process group: its pid
            assert set(_children()) - before == {pid}
            assert b"serve(" in _cmdline(pid)  # a fresh interpreter
    finally:
        done.set()
        thread.join()


def test_progress_bars_leave_no_thread_to_rule_out_fork():
    # tqdm's own bars start a monitor thread that lives as long as the process: after one, every
    # later search in the process would run fresh interpreters
    running = threading.active_count()
    for _ in ProgressBar(range(3), file=open(os.devnull, "w")):
        pass
    assert threading.active_count() == running


def test_meanwhile_runs_once_here_after_the_workers_have_their_items():
    calls = []
    with WorkerPool(2) as pool:
        pool.meanwhile(lambda: calls.append((os.getpid(), len(pool._processes))))
        assert pool.map(abs, []) == [] and calls == []  # nothing handed out: not yet
        assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
        assert calls == [(os.getpid(), 2)]  # in this process, both workers started
        assert pool.map(abs, [-4]) == [4] and len(calls) == 1  # once

"""Ctrl-C: the real CLI in a subprocess, a real SIGINT once its search workers run, and a search
from a script's module level (no ``__main__`` guard)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# A search of hundreds of trace shapes: minutes of work, so a command that goes on after Ctrl-C
# (as one did, running every queued batch first) outlives the generous timeout below.
MODEL_SECTION = {"num_layers": 48, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 512,
                 "vocab_size": 4096}
LONG_SEARCH = ["--gpus", "8:256", "--global-batch", "512", "--workers", "2", "--no-cache"]
LONG_SIZE = ["size", "--gpu", "A100", "--gpus", "8:256", "--days", "30", "--workers", "2", "--no-cache"]
# Two gloo ranks on the CPU: interrupted a second after they start, while they import torch.
PROFILE_COMM = ["profile-comm", "--device", "cpu", "--world-size", "2"]
TIMEOUT_S = 300  # generous: a process still running this long after SIGINT has ignored it


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended
            pass
    return children


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return None


def _sigint_default() -> None:
    """The CLI starts as from a terminal, with Ctrl-C's default action, even when these tests run in a
    background job (``make test &``, ``nohup``), which starts with SIGINT ignored and passes that on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv: list[str], *, whole_group: bool, workers: int = 2, settle_s: float = 1.0,
               signum: int = signal.SIGINT) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the CLI, send ``signum`` once ``workers`` worker processes run: to its process group, as a
    terminal's Ctrl-C does, or to its pid alone, as ``kill -INT`` does. Returns the finished
    process and the workers' command lines by pid."""
    proc = subprocess.Popen([sys.executable, "-m", "vtrain_plugin.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_children(proc.pid)) < workers:
            assert proc.poll() is None, f"vtrain exited ({proc.returncode}) before its workers started"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        time.sleep(settle_s)  # the workers are importing torch or evaluating: either way, they are running
        # multiprocessing's resource tracker (of profile-comm's ranks) is no worker: it leaves after its parent
        workers_seen = {pid: cmdline for pid in _children(proc.pid)
                        if b"resource_tracker" not in (cmdline := _cmdline(pid) or b"")}
        (os.killpg if whole_group else os.kill)(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), workers_seen


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL_SECTION, "cluster": {"preset": "dgx-a100"}}))
    return str(path)


@pytest.mark.parametrize("whole_group", [True, False], ids=["ctrl-c", "kill-int"])
@pytest.mark.parametrize("command", ["search", "size", "profile-comm"])
def test_sigint_is_one_line_exit_130_and_no_worker_left(tmp_path, model_file, command, whole_group):
    argv = {"search": ["search", model_file, *LONG_SEARCH], "size": LONG_SIZE,
            "profile-comm": [*PROFILE_COMM, "--db", str(tmp_path / "profiles.sqlite")]}[command]
    # interrupted once its two workers run: a search's and size's forked before they trace (without
    # the disk cache each traces its own plans' shapes, minutes for this space), profile-comm's ranks
    done, workers = _interrupt(argv, whole_group=whole_group, workers=2)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "vtrain: interrupted\n"
    assert done.stdout == ""
    assert len(workers) == 2
    assert [pid for pid, cmdline in workers.items() if _cmdline(pid) == cmdline] == []  # every worker is gone


def test_sigterm_to_a_search_is_one_line_exit_143_and_no_worker_left(tmp_path, model_file):
    """``kill`` or ``timeout`` signal the parent alone: it kills its workers (their own process group)."""
    argv = ["search", model_file, "--gpus", "8:256", "--global-batch", "512", "--workers", "2"]
    env_cache = ["--cache-dir", str(tmp_path / "cache")]  # its workers trace the shapes into this cache
    done, workers = _interrupt([*argv, *env_cache], whole_group=False, workers=2, signum=signal.SIGTERM)
    assert done.returncode == 143, done.stderr
    assert done.stderr.splitlines()[-1] == "vtrain: terminated"
    assert len(workers) == 2
    assert [pid for pid, cmdline in workers.items() if _cmdline(pid) == cmdline] == []  # every worker is gone


def test_search_at_a_scripts_module_level_runs_its_workers(tmp_path):
    script = tmp_path / "plans.py"
    script.write_text(textwrap.dedent("""\
        import vtrain_plugin
        from vtrain_plugin.hardware.clusters import get_cluster_preset
        from vtrain_plugin.planning import SearchSpace, search

        print("imported as", __name__)
        model = vtrain_plugin.ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
                                        vocab_size=1024)
        space = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1,),
                            sequence_parallel=(False,), recompute=("none",))
        result = search(model, cluster=get_cluster_preset("dgx-a100"), global_batch_size=8, gpus="2,4",
                        space=space, workers=2)
        print(len(result.table), "plans")
        """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "imported as __main__\n30 plans\n"

"""The ``vtrain`` program around :func:`main`: numpy's BLAS with one thread unless the user says
otherwise (set before numpy loads), the exit code of the command, and no garbage collection of
everything at exit (the objects frozen)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# console() with a stand-in main that reports what the command would see; its exit code is 3
PROBE = ("import gc, os, sys; from vtrain_plugin import cli; "
         "cli.main = lambda: print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules, "
         "gc.get_freeze_count() > 0) or 3; cli.console()")


def _python(code, **env):
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **env})


@pytest.mark.parametrize("given, seen", [(None, "1"), ("4", "4")])
def test_the_program_gives_blas_one_thread_unless_told_and_before_numpy_loads(given, seen):
    proc = _python(PROBE, **({} if given is None else {"OPENBLAS_NUM_THREADS": given}))
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == [seen, "False", "False"]


def test_the_program_exits_with_its_objects_frozen():
    code = PROBE.replace("cli.console()", "import atexit; atexit.register(lambda: print(gc.get_freeze_count() > 0)); "
                                          "cli.console()")
    proc = _python(code)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split()[-1] == "True"


def test_the_module_form_runs_the_program():
    proc = subprocess.run([sys.executable, "-m", "vtrain_plugin.cli", "estimate", "missing.yaml"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith("vtrain: error: ")

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.cpu_profile import TinyProfile, tiny_profile
from tests.support.zygote import Zygote

REPO = Path(__file__).resolve().parents[1]
_SESSION_CACHE = "VTRAIN_TEST_SESSION_TRACE_CACHE"  # the controller's cache, inherited by xdist workers


@pytest.fixture(scope="session")
def python_m():
    """``python -m MODULE ARGS`` as a real separate process, forked from this worker's zygote
    (tests/support/zygote.py: torch, megatron-core and vtrain imported once); same arguments and
    result as ``subprocess.run(..., capture_output=True, text=True)``, ``input`` its stdin.
    ``fresh=True``: a new interpreter, for what a fork cannot show (imports, interpreter flags, signals)."""
    zygote = Zygote()

    def run(module: str, *args: str, cwd: Path | str = REPO, env: dict | None = None, timeout: float = 600,
            fresh: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ if env is None else env)
        if fresh:
            return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                                  env=env, timeout=timeout, input=input)
        return zygote.run(module, list(args), cwd=cwd, env=env, timeout=timeout, input=input)
    yield run
    zygote.close()


@pytest.fixture
def run_cli(tmp_path, python_m):
    """Run the real ``vtrain`` CLI in a separate process (see ``python_m``); returns CompletedProcess."""
    def run(*args: str, check: bool = False, env: dict | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
        full_env = {**os.environ, "VTRAIN_PROFILE_DB": str(tmp_path / "profiles.sqlite"), **(env or {})}
        proc = python_m("vtrain_plugin.cli", *args, env=full_env, fresh=fresh)
        if check and proc.returncode != 0:
            raise AssertionError(f"vtrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc
    return run


@pytest.fixture(scope="session")
def tiny_cpu_profile(python_m) -> TinyProfile:
    """The kernels of tests/support/cpu_profile.py's tiny plan measured on this CPU, once per session
    (xdist workers included: they share the session's scratch folder)."""
    return tiny_profile(Path(os.environ[_SESSION_CACHE]) / "tiny-cpu-profile", python_m)


@pytest.fixture(autouse=True, scope="session")
def _package_calibrations_only(tmp_path_factory):
    """Estimates in tests use the calibration files shipped in the package, never a user's own, and
    no profile database unless a test names one (a user's would move every estimate it measured)."""
    os.environ["VTRAIN_CALIBRATION_DIR"] = str(tmp_path_factory.mktemp("no-user-calibrations"))
    os.environ["VTRAIN_PROFILE_DB"] = str(tmp_path_factory.mktemp("no-user-profiles") / "profiles.sqlite")


def pytest_configure(config):
    """Traces of the session (in this process and the CLI subprocesses, which inherit the
    environment) go to a trace cache of its own, empty at the start: tests never read or fill the
    user's cache, and every trace they read back was made by the code under test. Set here, before
    collection, so that a trace at a test module's import is covered too. Under pytest-xdist the
    workers share the controller's cache (entries are written atomically), so a shape traced by one
    worker is read by the others instead of traced again."""
    inherited = os.environ.get(_SESSION_CACHE) if os.environ.get("PYTEST_XDIST_WORKER") else None
    config._vtrain_owns_trace_cache = inherited is None
    config._vtrain_trace_cache = inherited or tempfile.mkdtemp(prefix="vtrain-test-trace-cache-")
    os.environ[_SESSION_CACHE] = config._vtrain_trace_cache
    os.environ["VTRAIN_CACHE_DIR"] = config._vtrain_trace_cache
    os.environ.pop("VTRAIN_NO_CACHE", None)
    os.environ.pop("VTRAIN_CACHE_MAX_MB", None)


def pytest_collection_finish(session):
    """Move what the imports and collection made (torch, megatron-core, the test modules: hundreds
    of thousands of objects that live to the end) out of the cyclic garbage collector's reach. Every
    trace runs a full collection (vtrain_plugin/capture/recorder.py, to drop the cycles that hold
    saved tensors, all made later), which would otherwise walk them all each time."""
    _freeze()


def pytest_runtest_logfinish(nodeid, location):
    """After a test that imported modules (the first trace imports megatron-core's models and layer
    specs: about 400,000 objects), collect its garbage and freeze what is left, as after collection.

    Why: a process that froze objects itself keeps vtrain's tracing from freezing them for it
    (vtrain_plugin/capture/child_trace.py), so every later trace's full collection walked them all,
    a third of its time. A collection and a freeze per test that imported something: a few dozen."""
    if len(sys.modules) != _frozen_modules[0]:
        gc.collect()
        _freeze()


_frozen_modules = [0]  # len(sys.modules) at the last freeze


def _freeze() -> None:
    gc.freeze()
    _frozen_modules[0] = len(sys.modules)


def pytest_unconfigure(config):
    if not getattr(config, "_vtrain_owns_trace_cache", False):
        return
    shutil.rmtree(getattr(config, "_vtrain_trace_cache", ""), ignore_errors=True)

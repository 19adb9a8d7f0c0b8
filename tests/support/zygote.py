"""A zygote for the tests' ``python -m MODULE ARGS`` processes: one helper process that has imported
torch, megatron-core and vtrain's commands, and forks a child per request, which runs the module's
real ``-m`` entry point with the request's argv, environment, working directory and stdin.

Why: a CLI subprocess pays about 4 CPU-seconds of imports before its work, and the suite starts
hundreds of them. Each child is still a separate process (its own exit status, stdout, stderr,
environment, module state: a fork of the untouched zygote, so nothing one child caches reaches the
next); only the imports are shared. What the interpreter reads at start-up cannot be forked: a
request whose start-up environment (``PYTHON*``, thread-pool and library variables) differs from the
zygote's runs as a plain subprocess, and so do tests that pass ``fresh=True`` to their runner.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# read by the interpreter, torch or its thread pools when they load: a request that sets them otherwise
# than the zygote's environment gets a fresh interpreter
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "CUDA", "LD_", "MALLOC_")
# megatron-core's GPT model and layer specs: what a child's first trace imports, frozen here with the
# rest (a child's traces do not freeze what its parent froze: vtrain_plugin/capture/child_trace.py)
_PRELOADED = ("torch", "megatron.core", "megatron.core.optimizer", "vtrain_plugin.estimate", "vtrain_plugin.capture.tracer",
              "vtrain_plugin.runs", "megatron_adapters", "vtrain_plugin.capture.megatron_chunk",
              "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs")


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads as it starts, before a fork could set them."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


class Zygote:
    """The test side: starts the helper on first use and runs ``python -m MODULE ARGS`` through it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="vtrain-test-zygote-"))
        self._count = 0

    def forkable(self, env: dict[str, str]) -> bool:
        """Whether a child forked from the zygote starts as a fresh interpreter given ``env`` would."""
        return self._proc is None or startup_environment(env) == startup_environment(self._env)

    def _start(self, env: dict[str, str]) -> None:
        self._env = dict(env)
        # unbuffered: select() on the answers must not miss a line already read into a buffer
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      cwd=REPO, env=self._env, bufsize=0)
        if self._proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the test zygote failed to start (exit {self._proc.wait()})")

    def run(self, module: str, args: list[str], *, cwd: Path | str, env: dict[str, str],
            timeout: float, input: str | None = None) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, ...)``,
        forked from the zygote; a fresh subprocess where the start-up environment differs. ``input``:
        the child's stdin (else an empty one)."""
        command = [sys.executable, "-m", module, *args]
        if self._proc is None:
            self._start(dict(os.environ))  # the session's start-up environment, whatever this request sets
        if not self.forkable(env):
            return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
                                  input=input)
        self._count += 1
        out, err = self._dir / f"{self._count}.out", self._dir / f"{self._count}.err"
        stdin = self._dir / f"{self._count}.in"
        stdin.write_text(input or "")
        request = {"module": module, "argv": [str(a) for a in args], "cwd": str(cwd), "env": env,
                   "stdin": str(stdin), "stdout": str(out), "stderr": str(err)}
        pid = None
        try:
            data = memoryview(json.dumps(request).encode() + b"\n")
            while data:
                data = data[self._proc.stdin.write(data):]
            pid = int(self._proc.stdout.readline())
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
            if not ready:
                _kill(pid)
                self._proc.stdout.readline()
                raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
            returncode = int(self._proc.stdout.readline())
        except BaseException as exc:
            if not isinstance(exc, subprocess.TimeoutExpired):  # a request cut short: the next gets a new zygote
                if pid is not None:
                    _kill(pid)
                self._stop()
            raise
        stdout, stderr = _read(out), _read(err)
        out.unlink(), err.unlink(), stdin.unlink()
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()  # the zygote leaves at the end of its requests
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def close(self) -> None:
        self._stop()
        for path in self._dir.iterdir():
            path.unlink()
        self._dir.rmdir()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it had just finished
        pass


def _read(path: Path) -> str:
    # as subprocess.run(text=True) decodes: the locale's encoding, universal newlines
    return path.read_text() if path.exists() else ""


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` run in CWD with ENV, and exit as it would."""
    import runpy
    import threading
    import traceback

    code = 0
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        stdin = os.open(request["stdin"], os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.path[0] = os.getcwd()  # what -m puts first: the working directory
        sys.argv = ["-m", *request["argv"]]
        runpy._run_module_as_main(request["module"], alter_argv=True)  # the entry of `python -m`
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
        traceback.print_exc()
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # the interpreter's own exit: non-daemon threads joined, atexit handlers run, streams flushed
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    """The zygote: import, then fork one child per request line on stdin; answer its pid, then its
    exit status as ``subprocess`` reports it."""
    import gc
    import importlib
    import threading
    import warnings

    requests, answers = os.fdopen(os.dup(0), "rb"), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1)  # nothing the imports print can reach the protocol
    os.close(null)
    sys.path[0] = str(REPO)
    with warnings.catch_warnings():  # as vtrain imports megatron-core (megatron_adapters.quiet_megatron)
        warnings.simplefilter("ignore")
        for name in _PRELOADED:
            importlib.import_module(name)
        import vtrain_plugin.cli

        vtrain_plugin.cli.command_modules()
    if threading.active_count() != 1:  # a fork copies only the thread that forks
        raise RuntimeError(f"the zygote has {threading.active_count()} threads after its imports")
    # the imports' objects out of the cyclic collector's reach: a child's full collections (one per
    # trace, vtrain_plugin/capture/recorder.py) skip them, and do not write to the pages it shares
    gc.freeze()
    os.write(answers, b"ready\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(answers)
            _child(request)
        os.write(answers, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, f"{os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve()

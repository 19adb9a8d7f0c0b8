"""Local worker processes of the search: forked from the caller where that is safe, else fresh interpreters.

Each worker runs the tasks its parent sends over a pipe (a search's trace jobs, then its batches
of plans), one at a time, until the parent hangs up. Workers run in a process group of their own,
so a terminal's Ctrl-C reaches only the parent; whenever the parent leaves the batches unfinished
(an error, KeyboardInterrupt) it kills its workers before the exception goes on.

Why not :mod:`multiprocessing`: its spawn and forkserver children import the caller's main script
again (a ``search()`` at a script's module level would then start workers from every worker), and
a ``ProcessPoolExecutor`` left by an exception, Ctrl-C included, first runs every batch still
queued. Why fork: the caller has already imported vtrain (and, before a search's tracing, torch and
megatron-core: the pool's ``preload``), so a forked worker starts with nothing to import or
compile and with the caller's in-process caches, where a fresh interpreter paid about a second of
CPU per worker. A fork copies only the thread that forks, so it is used only on Linux, with no
other Python thread running, no CUDA context and no ``torch.distributed`` process group; else, or
with ``fresh=True``, each worker is a fresh interpreter that imports vtrain alone.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from vtrain_plugin.planning.evaluate import Batch, Row, evaluate_batch

Results = list[tuple[int, Row]]
Item = TypeVar("Item")
log = logging.getLogger(__name__)


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as the cause of the one re-raised here."""


class WorkerPool:
    """Up to ``size`` worker processes, started when first needed (or by :meth:`start`) and kept for
    every :meth:`map` until :meth:`close` (a ``with`` block closes it), so a search's tracing and
    estimating phases start each worker once. ``preload`` runs here once before the first fork (the
    imports the forked workers then share); ``fresh=True`` starts fresh interpreters even where a
    fork is safe."""

    def __init__(self, size: int, *, preload: Callable[[], None] | None = None, fresh: bool = False) -> None:
        self.size = size
        self.max_size = size  # what the caller allowed; before_start may size the pool below it
        self.preload = preload
        self.fresh = fresh
        self._idle: list[tuple[Connection, Worker]] = []
        self._processes: list[Worker] = []
        self._ours: list[Connection] = []  # this process's end of every worker's pipe
        self._meanwhile: list[Callable[[], None]] = []

    def meanwhile(self, work: Callable[[], None]) -> None:
        """Run ``work`` here once the next :meth:`map` has handed every worker its first item (or,
        where no map follows, never): this process's own serial work done while the workers run."""
        self._meanwhile.append(work)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def before_start(self, *, size: int, preload: Callable[[], None] | None) -> None:
        """Until a worker has started: ``size`` workers (at most the pool's own), and ``preload``
        instead of the pool's (a search knows both once it has its plans: a best-first search's first
        round may be smaller than a later one, which may then start more); no-op afterwards."""
        if not self._processes:
            self.size, self.preload = min(self.max_size, size), preload

    def start(self) -> None:
        """Start every worker now: before this process starts a thread (a progress bar's), so they can be forked."""
        while len(self._processes) < self.size:
            self._idle.append(self._start())

    def map(self, function: Callable[[Item], Any], items: Sequence[Item],
            on_done: Callable[[Item], None] = lambda item: None) -> list[Any]:
        """``function(item)`` of every item, in the items' order, computed in the workers (one item
        per worker at a time, handed out in order; ``function`` a module-level function, the items
        plain data); ``on_done(item)`` as each completes. A worker's exception is raised here, after
        every worker is killed."""
        todo = list(reversed(range(len(items))))  # pop() hands them out in order
        running: dict[Connection, tuple[Worker, int]] = {}
        results: list[Any] = [None] * len(items)
        try:
            while todo and len(running) < self.size:
                connection, process = self._idle.pop() if self._idle else self._start()
                running[connection] = (process, todo.pop())
                connection.send((function, items[running[connection][1]]))
            while running and self._meanwhile:
                self._meanwhile.pop(0)()
            while running:
                for connection in wait(list(running)):
                    process, index = running.pop(connection)
                    results[index] = _receive(connection, process, items[index])
                    on_done(items[index])
                    if todo:
                        running[connection] = (process, todo.pop())
                        connection.send((function, items[running[connection][1]]))
                    else:
                        self._idle.append((connection, process))
            return results
        except BaseException:
            for connection in running:
                connection.close()
            self.close()
            raise

    def close(self) -> None:
        """Hang up on every worker (an idle one leaves) and kill any still running."""
        for connection, _ in self._idle:
            connection.close()
        self._idle.clear()
        for process in self._processes:
            process.kill()  # a no-op for a worker that has finished
            process.wait()
        self._processes.clear()
        self._ours.clear()

    def _start(self) -> tuple[Connection, Worker]:
        reason = "fresh=True" if self.fresh else fork_unsafe()
        if reason is None and self.preload is not None:
            preload, self.preload = self.preload, None
            preload()
            reason = fork_unsafe()  # what it imported may have started a thread
        ours, theirs = Pipe()
        if reason is None:
            process: Worker = _fork(theirs, ours, self._ours)
        else:
            log.debug("search worker: a fresh interpreter (%s)", reason)
            process = _spawn(theirs)
        theirs.close()
        self._processes.append(process)
        self._ours.append(ours)
        return ours, process


def fork_unsafe() -> str | None:
    """Why a worker cannot be forked from this process (None: it can). A fork copies only the
    thread that forks: locks other threads hold stay locked, a CUDA context and NCCL's threads do
    not come along."""
    if sys.platform != "linux":
        return f"no fork on {sys.platform}"
    if threading.active_count() > 1:
        return f"{threading.active_count()} threads running"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "a torch.distributed process group is up"
    return None


class Forked:
    """A worker forked from this process, with the part of :class:`subprocess.Popen` the pool uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)  # not reaped yet: the pid is still ours

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


Worker = subprocess.Popen | Forked


def _fork(theirs: Connection, ours: Connection, others: list[Connection]) -> Forked:
    """A worker forked from this process, serving ``theirs``."""
    sys.stdout.flush(), sys.stderr.flush()  # else the child would write this process's buffered output again
    pid = os.fork()
    if pid == 0:  # the worker: serve, then leave without running the caller's code, atexit handlers or finalisers
        code = 0
        try:
            os.setpgid(0, 0)
            for connection in (ours, *others):  # else a worker would hold another's pipe open
                connection.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0), os.close(null)
            os.dup2(2, 1)  # stdout: the command's output
            gc.freeze()  # the caller's objects: never collected here, so never copied by the collector's writes
            _serve(theirs)
        except KeyboardInterrupt:  # before it left the caller's process group: the caller reports it
            code = 130
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # here too, so no Ctrl-C reaches it before it has moved itself
    except (PermissionError, ProcessLookupError):  # it already has (or has exited)
        pass
    return Forked(pid)


def _spawn(theirs: Connection) -> subprocess.Popen:
    """A fresh interpreter that imports vtrain alone and serves ``theirs``."""
    # The parent's sys.path, as multiprocessing gives a spawned child: this copy of vtrain, installed or not.
    code = f"import sys; sys.path[:] = {sys.path!r}; from {__name__} import serve; serve({theirs.fileno()})"
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                            stdin=subprocess.DEVNULL, stdout=sys.__stderr__,  # stdout: the command's output
                            process_group=0)


def evaluate_in_workers(batches: Sequence[Batch], workers: int, on_plans: Callable[[int], None],
                        pool: WorkerPool | None = None) -> Results:
    """Evaluate ``batches`` in ``pool``'s processes, else in ``workers`` processes started here (at
    most one per batch); ``on_plans(n)`` as each batch of ``n`` plans completes. A worker's
    exception is raised here."""
    if pool is None:
        with WorkerPool(min(workers, len(batches))) as own:
            return evaluate_in_workers(batches, workers, on_plans, pool=own)
    done = pool.map(evaluate_batch, batches, lambda batch: on_plans(len(batch.candidates)))
    return [row for rows in done for row in rows]


def _receive(connection: Connection, process: Worker, item: Any) -> Any:
    try:
        reply = connection.recv()
    except EOFError:
        raise RuntimeError(f"search worker {process.pid} died (exit code {process.wait()}) on "
                           f"{_describe(item)}") from None
    if reply[0] == "error":
        raise reply[1] from WorkerTraceback(reply[2])
    return reply[1]


def _describe(item: Any) -> str:
    return f"{len(item.candidates)} plans" if isinstance(item, Batch) else type(item).__name__


def serve(fd: int) -> None:
    """A fresh worker's loop on its end of the pipe (:func:`_serve`)."""
    _serve(Connection(fd))


def _serve(connection: Connection) -> None:
    """The worker's loop: a function and its argument in, the result (or the exception and its
    traceback) out, until the parent hangs up."""
    from vtrain_plugin.capture import child_trace, disk_cache

    child_trace.own_this_process()  # traces here may keep older objects frozen for the worker's life
    disk_cache.keep_reads_frozen()  # and so may the trace-cache entries read here
    # (two marks, not one: a warm estimate reads the trace cache without loading child_trace)
    while True:
        try:
            function, item = connection.recv()
        except (EOFError, OSError):  # the parent is done, or gone
            return
        try:
            reply = ("done", function(item))
        except Exception as exc:
            reply = ("error", exc, traceback.format_exc())
        try:
            connection.send(reply)
        except OSError:  # the parent is gone
            return

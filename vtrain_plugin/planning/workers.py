"""Local worker processes of the search.

Not :mod:`multiprocessing`: its spawn and forkserver children import the caller's main script
again (a ``search()`` at a script's module level would then start workers from every worker),
fork would copy torch's thread pools, and a ``ProcessPoolExecutor`` left by an exception, Ctrl-C
included, first runs every batch still queued. Each worker here is a fresh interpreter that
imports vtrain alone and runs the tasks its parent sends over a pipe (a search's trace jobs, then
its batches of plans), one at a time, until the parent hangs up. Workers run in a process group of their own, so a terminal's Ctrl-C reaches
only the parent; whenever the parent leaves the batches unfinished (an error, KeyboardInterrupt)
it kills its workers before the exception goes on.
"""

from __future__ import annotations

import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from vtrain_plugin.planning.evaluate import Batch, Row, evaluate_batch

Results = list[tuple[int, Row]]
Item = TypeVar("Item")


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as the cause of the one re-raised here."""


class WorkerPool:
    """Up to ``size`` worker processes, started when first needed and kept for every :meth:`map`
    until :meth:`close` (a ``with`` block closes it), so a search's tracing and estimating phases
    pay each worker's imports once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[tuple[Connection, subprocess.Popen]] = []
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def map(self, function: Callable[[Item], Any], items: Sequence[Item],
            on_done: Callable[[Item], None] = lambda item: None) -> list[Any]:
        """``function(item)`` of every item, in the items' order, computed in the workers (one item
        per worker at a time, handed out in order; ``function`` a module-level function, the items
        plain data); ``on_done(item)`` as each completes. A worker's exception is raised here, after
        every worker is killed."""
        todo = list(reversed(range(len(items))))  # pop() hands them out in order
        running: dict[Connection, tuple[subprocess.Popen, int]] = {}
        results: list[Any] = [None] * len(items)
        try:
            while todo and len(running) < self.size:
                connection, process = self._idle.pop() if self._idle else self._start()
                running[connection] = (process, todo.pop())
                connection.send((function, items[running[connection][1]]))
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

    def _start(self) -> tuple[Connection, subprocess.Popen]:
        ours, theirs = Pipe()
        # The parent's sys.path, as multiprocessing gives a spawned child: this copy of vtrain, installed or not.
        code = f"import sys; sys.path[:] = {sys.path!r}; from {__name__} import serve; serve({theirs.fileno()})"
        with theirs:
            process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                       stdin=subprocess.DEVNULL, stdout=sys.__stderr__,  # stdout: the command's output
                                       process_group=0)
        self._processes.append(process)
        return ours, process


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


def _receive(connection: Connection, process: subprocess.Popen, item: Any) -> Any:
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
    """The worker's loop on its end of the pipe: a function and its argument in, the result (or the
    exception and its traceback) out."""
    connection = Connection(fd)
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

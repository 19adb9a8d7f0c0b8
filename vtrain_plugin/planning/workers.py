"""Local worker processes of the search.

Not :mod:`multiprocessing`: its spawn and forkserver children import the caller's main script
again (a ``search()`` at a script's module level would then start workers from every worker),
fork would copy torch's thread pools, and a ``ProcessPoolExecutor`` left by an exception, Ctrl-C
included, first runs every batch still queued. Each worker here is a fresh interpreter that
imports vtrain alone and evaluates the batches its parent sends over a pipe, one at a time, until
the parent hangs up. Workers run in a process group of their own, so a terminal's Ctrl-C reaches
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

from vtrain_plugin.planning.evaluate import Batch, Row, evaluate_batch

Results = list[tuple[int, Row]]


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as the cause of the one re-raised here."""


def evaluate_in_workers(batches: Sequence[Batch], workers: int, on_plans: Callable[[int], None]) -> Results:
    """Evaluate ``batches`` in ``workers`` processes (at most one per batch); ``on_plans(n)`` as
    each batch of ``n`` plans completes. A worker's exception is raised here."""
    todo = list(reversed(batches))  # pop() hands them out in order
    running: dict[Connection, tuple[subprocess.Popen, Batch]] = {}
    processes: list[subprocess.Popen] = []
    results: Results = []
    try:
        for _ in range(min(workers, len(batches))):
            connection, process = _start_worker()
            processes.append(process)
            running[connection] = (process, todo.pop())
            connection.send(running[connection][1])
        while running:
            for connection in wait(list(running)):
                process, batch = running.pop(connection)
                results.extend(_receive(connection, process, batch))
                on_plans(len(batch.candidates))
                if todo:
                    running[connection] = (process, todo.pop())
                    connection.send(running[connection][1])
                else:
                    connection.close()
        return results
    finally:
        for connection in running:
            connection.close()
        for process in processes:
            process.kill()  # a no-op for a worker that has finished
            process.wait()


def _start_worker() -> tuple[Connection, subprocess.Popen]:
    ours, theirs = Pipe()
    # The parent's sys.path, as multiprocessing gives a spawned child: this copy of vtrain, installed or not.
    code = f"import sys; sys.path[:] = {sys.path!r}; from {__name__} import serve; serve({theirs.fileno()})"
    with theirs:
        process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                   stdin=subprocess.DEVNULL, stdout=sys.__stderr__,  # stdout: the command's output
                                   process_group=0)
    return ours, process


def _receive(connection: Connection, process: subprocess.Popen, batch: Batch) -> Results:
    try:
        reply = connection.recv()
    except EOFError:
        raise RuntimeError(f"search worker {process.pid} died (exit code {process.wait()}) evaluating "
                           f"{len(batch.candidates)} plans") from None
    if reply[0] == "error":
        raise reply[1] from WorkerTraceback(reply[2])
    return reply[1]


def serve(fd: int) -> None:
    """The worker's loop on its end of the pipe: a batch in, its rows (or the exception and its
    traceback) out."""
    connection = Connection(fd)
    while True:
        try:
            batch = connection.recv()
        except (EOFError, OSError):  # the parent is done, or gone
            return
        try:
            reply = ("rows", evaluate_batch(batch))
        except Exception as exc:
            reply = ("error", exc, traceback.format_exc())
        try:
            connection.send(reply)
        except OSError:  # the parent is gone
            return

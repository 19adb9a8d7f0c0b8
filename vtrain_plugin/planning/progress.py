"""vtrain's progress bars: tqdm without its monitor thread.

tqdm starts a ``tqdm_monitor`` thread with its first bar and keeps it for the life of the process.
A search forks its workers only while the process runs one thread (``planning.workers.fork_unsafe``),
so after any bar every later search in the process (``vtrain size``, a notebook's second search)
would fall back to fresh interpreters. The monitor only refreshes bars that stall between updates;
vtrain's bars update per item, so they do without it. A subclass keeps the user's own bars as they are.
"""

from __future__ import annotations

from tqdm import tqdm


class ProgressBar(tqdm):
    """A tqdm bar that never starts tqdm's monitor thread."""

    monitor_interval = 0

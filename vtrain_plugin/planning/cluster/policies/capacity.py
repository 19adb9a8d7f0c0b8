"""The free GPUs of the cluster over the future, as reservations fill it (used by :mod:`.elastic_edf`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Reservation:
    gpus: int
    start_s: float
    end_s: float


class CapacityProfile:
    """Piecewise-constant free GPUs: ``free[k]`` from ``times[k]`` to ``times[k + 1]`` (the last
    one for ever), starting with every GPU free from ``now_s``."""

    def __init__(self, now_s: float, total_gpus: int) -> None:
        self.times = np.array([now_s], dtype=float)
        self.free = np.array([total_gpus], dtype=np.int64)

    @property
    def free_now(self) -> int:
        return int(self.free[0])

    def earliest(self, counts: np.ndarray, seconds_now: np.ndarray, seconds_later: np.ndarray,
                 deadline_s: float) -> Reservation | None:
        """The smallest of ``counts`` that runs to its end by ``deadline_s`` in free GPUs, at the
        earliest start (a breakpoint) it can: ``seconds_now`` are the run times when started now,
        ``seconds_later`` when started later (they differ by the restart a kept allocation saves)."""
        starts = self.times[:, None]
        ends = starts + np.vstack([seconds_now, np.broadcast_to(seconds_later, (len(self.times) - 1, len(counts)))])
        last = np.searchsorted(self.times, ends, side="left") - 1  # the last interval each run touches
        position = np.arange(len(self.times))
        # lowest[k, j]: the fewest free GPUs from interval k to interval j (j >= k)
        lowest = np.minimum.accumulate(np.where(position[None, :] >= position[:, None], self.free[None, :],
                                                np.iinfo(np.int64).max), axis=1)
        fits = (np.take_along_axis(lowest, last, axis=1) >= counts[None, :]) & (ends <= deadline_s)
        columns = np.flatnonzero(fits.any(axis=0))
        if not len(columns):
            return None
        column = columns[0]
        row = int(np.argmax(fits[:, column]))
        return Reservation(gpus=int(counts[column]), start_s=float(self.times[row]), end_s=float(ends[row, column]))

    def reserve(self, reservation: Reservation) -> None:
        """Take ``reservation.gpus`` from its start (a breakpoint) to its end."""
        end = int(np.searchsorted(self.times, reservation.end_s, side="left"))
        if end == len(self.times) or self.times[end] != reservation.end_s:
            self.times = np.insert(self.times, end, reservation.end_s)
            self.free = np.insert(self.free, end, self.free[end - 1])
        start = int(np.searchsorted(self.times, reservation.start_s, side="left"))
        self.free[start:end] -= reservation.gpus
        assert (self.free >= 0).all(), "a reservation overcommitted the profile"

"""The Pareto front of time against cost among the plans that fit in memory."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def pareto_front(time: ArrayLike, cost: ArrayLike, fits: ArrayLike) -> np.ndarray:
    """A boolean mask: True for the fitting plans that no other fitting plan dominates.

    A plan dominates another when it is no slower and no dearer, and faster or cheaper. Sorted by
    (time, cost), a plan is on the front iff it is the cheapest of the plans with its time and
    strictly cheaper than every faster plan (running minimum of cost); plans equal in both are on
    the front together. Plans that do not fit are never on it.
    """
    time = np.asarray(time, dtype=float)
    cost = np.asarray(cost, dtype=float)
    fits = np.asarray(fits, dtype=bool)
    if not (time.shape == cost.shape == fits.shape) or time.ndim != 1:
        raise ValueError("time, cost and fits must be 1-D arrays of one length")
    front = np.zeros(time.shape, dtype=bool)
    index = np.flatnonzero(fits)
    if index.size == 0:
        return front
    order = index[np.lexsort((cost[index], time[index]))]
    t, c = time[order], cost[order]
    first_of_time = np.searchsorted(t, t, side="left")  # start of each plan's equal-time run
    cheapest_before = np.concatenate(([np.inf], np.minimum.accumulate(c)))[first_of_time]
    front[order] = (c == c[first_of_time]) & (c < cheapest_before)
    return front

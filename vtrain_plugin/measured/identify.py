"""Which cluster constants a set of measured runs can identify.

Each run (one plan, its logs pooled) gives one number, its median iteration time, so it constrains
one combination of constants. A run *informs* a constant when moving that constant across its
documented range, the others held, moves the run's predicted time by at least
:data:`INFORMS_PCT` percent. A fit of ``k`` constants needs at least ``k`` runs, every constant
informed by one of them, and the runs' responses to the constants independent: the columns of the
(runs x constants) matrix of log-time responses, each scaled to unit length, must have a smallest
singular value of at least :data:`MIN_SEPARATION` (two constants that move every run in the same
proportions, such as GEMM efficiency and a fixed host cost on compute-bound runs, cannot be told
apart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from vtrain_plugin.core.errors import ConfigError

INFORMS_PCT = 1.0
MIN_SEPARATION = 0.1


def informed(effects: np.ndarray, names: Sequence[str]) -> list[tuple[str, ...]]:
    """Per run (a row of ``effects``: log of the time at the top of each constant's range over the
    time at its bottom), the constants it informs."""
    threshold = math.log1p(INFORMS_PCT / 100)
    return [tuple(n for n, e in zip(names, row) if abs(e) >= threshold) for row in effects]


def unidentifiable(effects: np.ndarray, names: Sequence[str], labels: Sequence[str]) -> str | None:
    """Why ``names`` cannot be fitted to the runs ``labels`` (one line), or None when they can."""
    informs = informed(effects, names)
    uninformed = [n for n in names if not any(n in row for row in informs)]
    if len(labels) < len(names):
        reason = f"{len(labels)} run{'s' * (len(labels) != 1)} cannot identify {len(names)} constants"
    elif uninformed:
        reason = f"{', '.join(uninformed)} {'is' if len(uninformed) == 1 else 'are'} informed by no run"
    else:
        columns = effects / np.linalg.norm(effects, axis=0)
        separation = float(np.linalg.svd(columns, compute_uv=False)[-1])
        if separation >= MIN_SEPARATION:
            return None
        cosines = columns.T @ columns
        np.fill_diagonal(cosines, 0.0)
        a, b = np.unravel_index(np.argmax(np.abs(cosines)), cosines.shape)
        reason = (f"the runs move {names[a]} and {names[b]} alike (response cosine {abs(cosines[a, b]):.3f}; "
                  f"separation {separation:.3f} < {MIN_SEPARATION})")
    each = "; ".join(f"{label} informs {', '.join(row) or 'nothing'}" for label, row in zip(labels, informs))
    return (f"refusing to fit {', '.join(names)}: {reason} ({each}; a run informs a constant that moves its "
            f"prediction by {INFORMS_PCT:g}% or more across its range): fit fewer constants (--fit) or add runs")


def check_identifiable(effects: np.ndarray, names: Sequence[str], labels: Sequence[str]) -> None:
    reason = unidentifiable(effects, names, labels)
    if reason is not None:
        raise ConfigError(reason)

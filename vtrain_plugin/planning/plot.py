"""A picture of a search: every plan's time against its cost, the Pareto front, a baseline."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vtrain_plugin.core.files import atomic_write_bytes
from vtrain_plugin.planning.search import SearchResult
from vtrain_plugin.planning.sizing import SizingResult

AXIS_LABELS = {
    "iteration_time_ms": "iteration time (ms)",
    "train_days": "days to train",
    "cost_usd": "cost per iteration (USD)",
    "train_cost_usd": "cost to train (USD)",
    "gpu_hours": "GPU-hours per iteration",
}
_WIDE = 20.0  # log scale on an axis whose values span more than this factor


def plot_search(result: SearchResult, path: str | os.PathLike, *, baseline: Mapping[str, Any] | None = None,
                baseline_label: str = "baseline", title: str = "") -> None:
    """Write a PNG of ``result`` to ``path`` (atomically): plans that fit as dots, the others grey
    crosses, the front as a step line, and ``baseline`` (a row with the table's columns) as a
    labelled star."""
    table, x, y = result.table, result.time_column, result.cost_column
    figure, ax = _figure()
    fits = table["fits_in_memory"].to_numpy(dtype=bool)
    if not fits.all():
        ax.scatter(table[x][~fits], table[y][~fits], marker="x", s=14, color="0.7", label="does not fit in memory")
    ax.scatter(table[x][fits], table[y][fits], s=14, color="tab:blue", alpha=0.6, label="fits in memory")
    front = result.front
    ax.step(front[x], front[y], where="post", color="tab:orange", linewidth=1.5)
    ax.scatter(front[x], front[y], s=30, color="tab:orange", zorder=3, label="Pareto front")
    if baseline is not None:
        ax.scatter([baseline[x]], [baseline[y]], marker="*", s=180, color="tab:red", zorder=4, label=baseline_label)
        ax.annotate(baseline_label, (baseline[x], baseline[y]), xytext=(-8, 8), textcoords="offset points",
                    ha="right", color="tab:red")
    for values, set_scale in ((table[x], ax.set_xscale), (table[y], ax.set_yscale)):
        positive = values.to_numpy(dtype=float)
        positive = positive[np.isfinite(positive) & (positive > 0)]
        if positive.size and positive.max() > _WIDE * positive.min():
            set_scale("log")
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    ax.set_title(title or f"{len(table):,} plans, {int(front.shape[0])} on the Pareto front")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    _save(figure, path)


def plot_sizing(result: SizingResult, path: str | os.PathLike) -> None:
    """Write a PNG of ``vtrain size`` to ``path`` (atomically): each searched shape's parameters
    against its days to train with its best plan, the days budget, the answer and the naive answer."""
    figure, ax = _figure()
    shapes = [o for o in result.evaluated if o.plan is not None]
    for within, color, label in ((True, "tab:green", "within budget"), (False, "tab:red", "over budget")):
        chosen = [o for o in shapes if o.within_budget is within]
        ax.scatter([o.model.num_parameters for o in chosen], [o.train_days for o in chosen], s=30, color=color,
                   label=label, zorder=3)
    ax.plot([o.model.num_parameters for o in shapes], [o.train_days for o in shapes], color="0.6", linewidth=1)
    if result.days is not None:
        ax.axhline(result.days, color="black", linestyle="--", linewidth=1, label=f"budget: {result.days:g} days")
    answer = result.answer
    ax.annotate(f"answer: {answer.model.name}", (answer.model.num_parameters, answer.train_days),
                xytext=(6, -14), textcoords="offset points", color="tab:green")
    if result.naive_outcome is not None and result.naive_outcome.plan is not None:
        naive = result.naive_outcome
        ax.scatter([naive.model.num_parameters], [naive.train_days], marker="*", s=180, color="tab:orange",
                   zorder=4, label=f"naive answer ({100 * result.naive_mfu:.0f}% MFU)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("days to train (compute-optimal tokens)")
    ax.set_title("largest model within budget")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    _save(figure, path)


def _figure() -> tuple[Any, Any]:
    """A new figure and its axes. matplotlib is imported here: it takes half a second to load, and
    the CLI imports this module for every command, plotting or not."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _save(figure: Any, path: str | os.PathLike) -> None:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(Path(path), buffer.getvalue())

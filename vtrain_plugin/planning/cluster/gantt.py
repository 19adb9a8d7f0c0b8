"""A Gantt-style picture of one simulation: each job's GPUs over time, and the cluster's use.

Top: one row per job (by submission), a bar for each stretch on a fixed GPU count, coloured by that
count (log scale), a tick at the deadline, a cross at the submission of a rejected job. Bottom:
GPUs held over time against the cluster's.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from vtrain_plugin.core.files import atomic_write_bytes
from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.planning.cluster.simulator import SimulationResult


def plot_gantt(result: SimulationResult, path: str | os.PathLike, *, title: str = "") -> None:
    """Write the PNG of ``result`` to ``path`` (atomically)."""
    outcomes = sorted(result.outcomes, key=lambda o: (o.submit_s, o.name))
    row = {o.name: i for i, o in enumerate(outcomes)}
    counts = [s.gpus for s in result.segments] or [1]
    norm = LogNorm(vmin=min(counts), vmax=max(max(counts), min(counts) + 1))
    cmap = colormaps["viridis"]
    figure = Figure(figsize=(11, 4 + 0.08 * len(outcomes)), dpi=110)
    FigureCanvasAgg(figure)
    jobs_ax, use_ax = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for segment in result.segments:
        start, length = segment.start_s / SECONDS_PER_HOUR, (segment.end_s - segment.start_s) / SECONDS_PER_HOUR
        jobs_ax.broken_barh([(start, length)], (row[segment.job] - 0.4, 0.8), color=cmap(norm(segment.gpus)))
    met = [o for o in outcomes if o.finish_s is not None]
    jobs_ax.scatter([o.deadline_s / SECONDS_PER_HOUR for o in met], [row[o.name] for o in met], marker="|",
                    color=["black" if o.met_deadline else "red" for o in met], s=30, label="deadline (red: missed)")
    rejected = [o for o in outcomes if o.rejected]
    if rejected:
        jobs_ax.scatter([o.submit_s / SECONDS_PER_HOUR for o in rejected], [row[o.name] for o in rejected],
                        marker="x", color="0.5", s=16, label="rejected")
    jobs_ax.set_ylim(len(outcomes) - 0.5, -0.5)
    jobs_ax.set_ylabel("job (by submission)")
    jobs_ax.legend(loc="upper right", fontsize=8)
    colorbar = figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[jobs_ax, use_ax], pad=0.01)
    colorbar.set_label("GPUs")
    times, held = _held(result)
    use_ax.step(times / SECONDS_PER_HOUR, held, where="post", color="tab:blue", lw=1)
    use_ax.fill_between(times / SECONDS_PER_HOUR, held, step="post", alpha=0.3, color="tab:blue")
    use_ax.axhline(result.cluster.total_gpus, color="black", lw=0.8, ls="--")
    use_ax.set_ylim(0, result.cluster.total_gpus * 1.05)
    use_ax.set_ylabel("GPUs held")
    use_ax.set_xlabel("hours")
    jobs_ax.set_title(title or f"{result.policy} on {result.cluster.describe()}")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(Path(path), buffer.getvalue())


def _held(result: SimulationResult) -> tuple[np.ndarray, np.ndarray]:
    """GPUs held over time: (change times, GPUs held from each)."""
    changes: dict[float, int] = {}
    for s in result.segments:
        changes[s.start_s] = changes.get(s.start_s, 0) + s.gpus
        changes[s.end_s] = changes.get(s.end_s, 0) - s.gpus
    times = np.array(sorted(changes) or [0.0])
    return times, np.cumsum([changes.get(t, 0) for t in times])

"""A picture of a comparison: each logged interval's time against its iteration, and the prediction."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

from vtrain_plugin.core.files import atomic_write_bytes
from vtrain_plugin.measured.compare_run import RunComparison, after_warmup


def plot_comparisons(comparisons: Sequence[tuple[str, RunComparison]], path: str | os.PathLike) -> None:
    """Write a PNG to ``path`` (atomically), one panel per ``(label, comparison)``: the measured
    intervals as dots at their last iteration (warm-up grey, slow ones red), the measured median
    and the predicted time as lines. matplotlib is imported here: it takes half a second to load."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 3.2 * len(comparisons)), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    for ax, (label, c) in zip(figure.subplots(len(comparisons), 1, squeeze=False)[:, 0], comparisons):
        slow = {(s.path, s.line, s.iteration) for s in c.slow}
        for log in c.logs:
            kept = set(map(id, after_warmup(log.intervals, c.warmup_iterations)))
            groups = {"warm-up": [], "measured": [], "slow": []}
            for i in log.intervals:
                kind = ("slow" if (log.path, i.line, i.iteration) in slow else "measured") if id(i) in kept \
                    else "warm-up"
                groups[kind].append(i)
            for kind, color in (("warm-up", "0.6"), ("measured", "tab:blue"), ("slow", "tab:red")):
                points = groups[kind]
                if points:
                    ax.scatter([i.iteration for i in points], [i.iteration_time_ms for i in points], s=12,
                               color=color, label=kind if log is c.logs[0] else None, zorder=3)
        ax.axhline(c.measured_iteration_time_ms, color="tab:blue", linewidth=1, linestyle=":",
                   label=f"measured median {c.measured_iteration_time_ms:,.1f} ms")
        ax.axhline(c.predicted_iteration_time_ms, color="tab:orange", linewidth=1.5,
                   label=f"predicted {c.predicted_iteration_time_ms:,.1f} ms ({c.iteration_time_error_pct:+.1f}%)")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("iteration time (ms)")
        ax.legend(fontsize=7)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(Path(path), buffer.getvalue())

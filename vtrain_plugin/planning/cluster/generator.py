"""Synthetic job mixes, reproducible from a seed (``vtrain cluster-sim --generate N --seed S``).

For each job, drawn with NumPy's generator seeded with ``seed``:

- a model among :attr:`MixSpec.models` (presets; those that fit nowhere on the cluster are left
  out), smaller ones more often: weight proportional to 1 / sqrt(parameters), so that with the
  default mix about half the jobs train GPT-3 1.3B and one in twenty-five GPT-3 175B;
- a global batch from :attr:`MixSpec.batch_tokens` (tokens per iteration, in whole sequences), so
  jobs share throughput curves;
- the GPUs it asks for: its smallest count with a plan times 1, 2, 4 or 8 (uniform, up to
  ``max_scale``), down to the nearest count that is faster than every smaller one;
- its ideal duration, log-uniform in :attr:`MixSpec.hours`, on the GPUs it asks for; the tokens are
  the whole iterations that take closest to it, and the ideal time is theirs plus one restart;
- its deadline: submission plus a slack factor, uniform in :attr:`MixSpec.slack`, times its ideal time.

Arrivals are a Poisson process whose rate makes the offered load (GPU-hours the jobs ask for over
the cluster's GPU-hours while they arrive) equal :attr:`MixSpec.load`; the first job arrives at 0.
Times are rounded to 1e-4 hours (0.36 s) as they are written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.model_family import model_preset
from vtrain_plugin.specs.model import ModelSpec

DEFAULT_MODELS = ("gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "llama2-70b", "gpt3-175b")
DEFAULT_BATCH_TOKENS = (2**20, 2**21)  # 1M and 2M tokens per iteration
CurveSource = Callable[[ModelSpec, int], ThroughputCurve]


@dataclass(frozen=True, slots=True, kw_only=True)
class MixSpec:
    jobs: int
    seed: int
    models: tuple[str, ...] = DEFAULT_MODELS
    batch_tokens: tuple[int, ...] = DEFAULT_BATCH_TOKENS
    slack: tuple[float, float] = (1.5, 3.0)  # deadline slack: low, high (equal for one value)
    load: float = 1.0
    hours: tuple[float, float] = (0.5, 24.0)  # ideal duration: low, high
    max_scale: int = 8  # the largest multiple of its smallest count a job asks for
    restart_s: float = 0.0  # part of the ideal time

    def __post_init__(self) -> None:
        v.positive_int("generate", self.jobs)
        v.non_negative_int("seed", self.seed)
        if not self.models:
            raise ConfigError("models: give at least one model preset")
        for name in self.models:
            model_preset(name)
        for tokens in self.batch_tokens:
            v.positive_int("batch_tokens", tokens)
        for name, (low, high) in (("slack", self.slack), ("hours", self.hours)):
            v.positive_number(name, low)
            v.positive_number(name, high)
            if low > high:
                raise ConfigError(f"{name}: the range {low:g}:{high:g} is empty (low > high)")
        if self.slack[0] < 1:
            raise ConfigError(f"slack must be at least 1 (a deadline before the ideal finish), got {self.slack[0]:g}")
        v.positive_number("load", self.load)
        v.positive_int("max_scale", self.max_scale)
        v.non_negative_number("restart_s", self.restart_s)

    def shapes(self) -> list[tuple[ModelSpec, int]]:
        """Every (model, global batch) the mix may draw: the curves it may need."""
        return [(model_preset(name), _batch(model_preset(name), tokens)) for name in self.models
                for tokens in self.batch_tokens]


def generate_jobs(mix: MixSpec, cluster: ClusterConfig, curve_for: CurveSource) -> list[dict[str, Any]]:
    """Job-file entries of a synthetic mix (see the module doc); ``curve_for(model, global_batch)``
    gives the curves that set requests, durations and tokens."""
    rng = np.random.default_rng(mix.seed)
    models = [model_preset(name) for name in mix.models]
    fitting = [m for m in models if curve_for(m, _batch(m, mix.batch_tokens[0])).fits]
    if not fitting:
        reasons = "; ".join(f"{m.name}: {curve_for(m, _batch(m, mix.batch_tokens[0])).reason}" for m in models)
        raise ConfigError(f"no model of the mix fits on {cluster.describe()}: {reasons}")
    weights = np.array([m.num_parameters ** -0.5 for m in fitting])
    rows, work = [], []
    scales = [2**k for k in range(int(math.log2(mix.max_scale)) + 1)]
    for number in range(1, mix.jobs + 1):
        model = fitting[rng.choice(len(fitting), p=weights / weights.sum())]
        batch = _batch(model, mix.batch_tokens[rng.integers(len(mix.batch_tokens))])
        curve = curve_for(model, batch)
        if not curve.fits:  # fits at the first batch size, not at this one
            batch = _batch(model, mix.batch_tokens[0])
            curve = curve_for(model, batch)
        target = curve.min_gpus * scales[rng.integers(len(scales))]
        gpus = max(n for n in curve.efficient_counts() if n <= target)
        hours = math.exp(rng.uniform(math.log(mix.hours[0]), math.log(mix.hours[1])))
        iterations = max(1, round(hours * SECONDS_PER_HOUR / curve.iteration_s(gpus)))
        ideal_s = mix.restart_s + iterations * curve.iteration_s(gpus)
        rows.append({"name": f"job-{number:0{len(str(mix.jobs))}d}", "model": model.name, "global_batch": batch,
                     "tokens": iterations * batch * model.seq_length, "gpus": gpus,
                     "slack": rng.uniform(*mix.slack), "ideal_s": ideal_s})
        work.append(gpus * ideal_s)
    mean_gap_s = sum(work) / (mix.jobs * mix.load * cluster.total_gpus)
    submit_s = np.concatenate([[0.0], np.cumsum(rng.exponential(mean_gap_s, mix.jobs - 1))])
    for row, submit in zip(rows, submit_s):
        slack, ideal_s = row.pop("slack"), row.pop("ideal_s")
        row["submit_hours"] = round(float(submit) / SECONDS_PER_HOUR, 4)
        row["deadline_hours"] = round(float(submit + slack * ideal_s) / SECONDS_PER_HOUR, 4)
    order = ("name", "submit_hours", "model", "global_batch", "tokens", "deadline_hours", "gpus")
    return [{key: row[key] for key in order} for row in rows]


def _batch(model: ModelSpec, tokens: int) -> int:
    return max(1, tokens // model.seq_length)

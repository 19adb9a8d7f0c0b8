"""How far off an estimate is likely to be: the errors of the published runs in its regime.

``data/error_bands.json`` holds the signed error, ``(predicted - measured) / measured``, of every
run of the published data sets under ``benchmarks/data`` as the shipped constants predict it, with
the run's regime (GPU architecture, software stack, GPUs, parameters, experts). It is written by
``python -m benchmarks.accuracy.error_bands`` (``make error-bands``), never by hand. An estimate's
band (:func:`error_band`) is the 10th to 90th percentile of the errors of the runs of its regime.

Why: one figure says nothing of how sure it is; the same model is within 3% in one regime and 60%
too fast in another (the host-bound small runs of today's stack). The band says which, from the
runs that measured it, and a plan in a regime no run measured is said to be far from calibration.

The regime is the tuple (architecture, software stack, GPU bucket, size bucket, dense or MoE) of
:func:`regime_of`; a model with experts (``ModelSpec.num_experts``) is MoE, a plain module dense.
Percentiles are those of the empirical distribution (numpy's ``inverted_cdf``): with fewer than ten
runs the band is the smallest to the largest error, and at least 80% of a regime's runs lie inside
its band. A regime with fewer than :data:`MIN_RUNS` runs borrows the runs of the nearest wider one
and says which it used (:func:`_searches`, narrowest first). The model's size is kept longest: it
tells the host- and launch-bound small models from the GEMM-bound large ones, whose errors differ
most. Dense or MoE is kept next longest: MoE errors spread wider than dense ones and lean to too
fast (token dispatch, grouped GEMMs and routing imbalance are what the model is least sure of), so a
dense band would be overconfident for an MoE plan. Keeping both: any GPU count, then any
architecture, then any stack. Then a dense plan takes the dense runs of any size, and every run
last: it never borrows an MoE run before that. An MoE plan without five MoE runs of its size takes
the dense runs of its size, widened the same way, with the MoE runs of its size there are (they
belong in its band, but two or three runs alone give one too narrow to hold the next), and says so:
"only 2 MoE runs of this size calibrated; band of them and of dense runs", or "no MoE run of this
size calibrated; band of dense runs" (then its own regime has no run: far from calibration); with no
run of its size at all, the MoE runs of any size, then every run. An error band is the measured time
the errors imply: ``predicted / (1 + error)``, so a regime predicted too fast has its band above the
estimate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from vtrain_plugin.core.errors import ConfigError

FORMAT_VERSION = 2
ERROR_BANDS_FILE = Path(__file__).with_name("data") / "error_bands.json"
PERCENTILES = (10.0, 90.0)
MIN_RUNS = 5  # runs a regime needs to give its own band (below: the nearest wider regime's)
# (upper bound, label) of the buckets of a regime: GPUs of the job, parameters of the model
GPU_BUCKETS = ((8, "1-8 GPUs"), (64, "9-64 GPUs"), (512, "65-512 GPUs"), (4096, "513-4,096 GPUs"),
               (math.inf, "over 4,096 GPUs"))
SIZE_BUCKETS = ((1e8, "under 100M parameters"), (1e9, "100M-1B parameters"), (10e9, "1-10B parameters"),
                (100e9, "10-100B parameters"), (math.inf, "over 100B parameters"))
# Which of (architecture, stack, GPUs) a widening keeps, narrowest first; the model's size and kind
# are kept through all of them (see the module doc for why, and for what follows).
_SIZE_KEPT = ((True, True, True), (True, True, False), (False, True, True), (False, True, False),
              (False, False, True), (False, False, False))
_SIZE_AND_KIND = (False, False, False, True, True)  # the runs of its size and kind
_KIND_ONLY = (False, False, False, False, True)  # the runs of its kind, any size
_EVERY_RUN = (False, False, False, False, False)
NO_MOE_RUN = "no MoE run of this size calibrated; band of dense runs"


class ModelKind(StrEnum):
    """Whether a regime's model has experts (``ModelSpec.num_experts``)."""

    DENSE = "dense"
    MOE = "MoE"


DENSE, MOE = ModelKind.DENSE, ModelKind.MOE


def _bucket(value: float, buckets: Sequence[tuple[float, str]]) -> str:
    return next(label for bound, label in buckets if value <= bound)


@dataclass(frozen=True, slots=True)
class Regime:
    """Where a run sits: GPU architecture, software stack, GPU bucket, size bucket, dense or MoE."""

    architecture: str
    software_stack: str
    gpus: str
    size: str
    kind: ModelKind

    def _parts(self) -> tuple[str, ...]:
        return self.architecture, self.software_stack, self.gpus, self.size, self.kind

    def words(self, mask: tuple[bool, ...] = (True,) * 5) -> str:
        parts = [p for p, keep in zip(self._parts(), mask) if keep]
        return ", ".join(parts) if parts else "every run"

    def matches(self, other: Regime, mask: tuple[bool, ...]) -> bool:
        return all(not keep or a == b for a, b, keep in zip(self._parts(), other._parts(), mask))


def regime_of(*, architecture: str, software_stack: str, num_gpus: int, parameters: float, moe: bool) -> Regime:
    """The regime of a run of ``parameters`` on ``num_gpus`` GPUs of ``architecture`` with
    ``software_stack``, of a model with experts (``moe``) or without."""
    return Regime(str(architecture), str(software_stack), _bucket(num_gpus, GPU_BUCKETS),
                  _bucket(parameters, SIZE_BUCKETS), MOE if moe else DENSE)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationRun:
    """One published run as the shipped constants predict it (a row of the error-band file)."""

    dataset: str
    run: str  # which row of the data set
    architecture: str
    software_stack: str
    num_gpus: int
    parameters: int
    num_experts: int | None  # the model's (ModelSpec.num_experts); None: dense
    predicted_ms: float
    measured_ms: float

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms

    @property
    def regime(self) -> Regime:
        return regime_of(architecture=self.architecture, software_stack=self.software_stack,
                         num_gpus=self.num_gpus, parameters=self.parameters, moe=self.num_experts is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "run": self.run, "architecture": self.architecture,
                "software_stack": self.software_stack, "num_gpus": self.num_gpus, "parameters": self.parameters,
                "num_experts": self.num_experts, "predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms,
                "error_pct": self.error_pct}


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorBand:
    """The likely error of one estimate: the p10-p90 signed error of the calibration runs used."""

    regime: str  # the estimate's own regime, in words
    moe: bool  # the estimate's model has experts
    runs_in_regime: int  # calibration runs in it (0: far from calibration)
    based_on: str  # the regime whose runs give the band, in words (the estimate's own, or a wider one)
    runs: int  # how many runs that is
    low_error_pct: float  # 10th percentile of their signed errors (negative: predicted too fast)
    high_error_pct: float  # 90th percentile
    # what the user must know of the runs used: an MoE plan given too few MoE runs, or dense ones
    note: str = ""

    @property
    def far(self) -> bool:
        """No calibration run in the estimate's own regime."""
        return self.runs_in_regime == 0

    def measured(self, predicted: float) -> tuple[float, float]:
        """What a predicted quantity that scales with time (ms, dollars) likely measures: low, high."""
        return predicted / (1 + self.high_error_pct / 100), predicted / (1 + self.low_error_pct / 100)

    def words(self) -> str:
        """Where the band comes from, e.g. "p10-p90 error -8.1% to +4.2% of 26 calibration runs of its
        regime (ampere, megatron_deepspeed_2023, 9-64 GPUs, 1-10B parameters, dense)"."""
        runs = f"{self.runs} calibration run{'s' * (self.runs != 1)}"
        text = f"p10-p90 error {self.low_error_pct:+.1f}% to {self.high_error_pct:+.1f}% of {runs}"
        if self.based_on == self.regime:
            return f"{text} of its regime ({self.regime})"
        text += f" of the wider regime ({self.based_on})" + (f"; {self.note}" if self.note else "")
        if self.far:
            return f"{text}; far from any calibration run: none in its regime ({self.regime})"
        return f"{text}; {self.runs_in_regime} in its regime ({self.regime})"

    def to_dict(self, predicted_ms: float, cost_usd: float | None) -> dict[str, Any]:
        low_ms, high_ms = self.measured(predicted_ms)
        return {"regime": self.regime, "moe": self.moe, "runs_in_regime": self.runs_in_regime,
                "far_from_calibration": self.far, "based_on": self.based_on, "runs": self.runs,
                "note": self.note or None, "low_error_pct": self.low_error_pct, "high_error_pct": self.high_error_pct,
                "iteration_time_ms": [low_ms, high_ms],
                "cost_usd": None if cost_usd is None else list(self.measured(cost_usd))}


def _searches(regime: Regime) -> list[tuple[Regime, tuple[bool, ...]]]:
    """The regimes :func:`band_from` tries for ``regime``, narrowest first: (regime to match, which
    of its parts must match), in the order of the module doc."""
    steps = [(regime, (*keep, True, True)) for keep in _SIZE_KEPT]
    if regime.kind == MOE:  # then the dense runs of its size (band_from adds the few MoE ones)
        dense = replace(regime, kind=DENSE)
        steps += [(dense, (*keep, True, True)) for keep in _SIZE_KEPT]
    return [*steps, (regime, _KIND_ONLY), (regime, _EVERY_RUN)]


def band_from(runs: Sequence[CalibrationRun], regime: Regime) -> ErrorBand | None:
    """The band of ``regime`` from ``runs`` (see the module doc); None without runs."""
    if not runs:
        return None
    own = sum(1 for r in runs if r.regime == regime)
    # an MoE plan given dense runs keeps the MoE runs of its size, too few for a band of their own
    few = [r.error_pct for r in runs if regime.kind == MOE and r.regime.matches(regime, _SIZE_AND_KIND)]
    for target, mask in _searches(regime):
        errors = [r.error_pct for r in runs if r.regime.matches(target, mask)]
        based_on, note = target.words(mask), ""
        if target.kind != regime.kind:
            errors += few
            if few:
                based_on += f" + {regime.words(_SIZE_AND_KIND)}"
                note = (f"only {len(few)} MoE run{'s' * (len(few) != 1)} of this size calibrated; "
                        "band of them and of dense runs")
            else:
                note = NO_MOE_RUN
        if len(errors) >= MIN_RUNS or (mask == _EVERY_RUN and errors):
            low, high = np.percentile(errors, PERCENTILES, method="inverted_cdf")
            return ErrorBand(regime=regime.words(), moe=regime.kind == MOE, runs_in_regime=own, based_on=based_on,
                             runs=len(errors), low_error_pct=float(low), high_error_pct=float(high), note=note)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorBands:
    """The contents of the error-band file: its provenance and the runs."""

    provenance: dict[str, Any]
    runs: tuple[CalibrationRun, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "percentiles": list(PERCENTILES), "min_runs": MIN_RUNS,
                "provenance": self.provenance, "runs": [r.to_dict() for r in self.runs]}


def read_error_bands(path: str | Path = ERROR_BANDS_FILE) -> ErrorBands:
    return _read(str(path))


@lru_cache(maxsize=4)
def _read(path: str) -> ErrorBands:
    where = f"error-band file {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({exc})") from exc
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{where}: format_version must be {FORMAT_VERSION}")
    fields = CalibrationRun.__dataclass_fields__
    try:
        runs = tuple(CalibrationRun(**{k: v for k, v in row.items() if k in fields}) for row in data["runs"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: runs must be objects with {', '.join(fields)} ({exc})") from exc
    return ErrorBands(provenance=dict(data.get("provenance", {})), runs=runs)


def error_band(*, architecture: str, software_stack: str, num_gpus: int, parameters: float,
               moe: bool) -> ErrorBand | None:
    """The band of an estimate in this regime from the shipped file (None: no file shipped)."""
    return _shipped_band(regime_of(architecture=architecture, software_stack=software_stack, num_gpus=num_gpus,
                                   parameters=parameters, moe=moe))


@lru_cache(maxsize=256)
def _shipped_band(regime: Regime) -> ErrorBand | None:
    """Once per regime: a search estimates thousands of plans in a handful of regimes."""
    if not ERROR_BANDS_FILE.is_file():
        return None
    return band_from(read_error_bands(ERROR_BANDS_FILE).runs, regime)

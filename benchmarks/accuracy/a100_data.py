"""The measured A100 runs published with vTrain, as vTrain configs and vtrain run configs.

Shared by ``calibrate.py`` and ``published_runs.py``. The calibration CSVs live in
``benchmarks/data`` (override with ``--data DIR``); each row becomes the vTrain
config that describes the measured run (Megatron-DeepSpeed, fp16, full activation recompute, 1F1B,
one gradient all-reduce after the last backward, DGX A100 nodes with 8 x 200 Gb/s InfiniBand).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vtrain_plugin.runs import run_config_from_dict
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cost.prepare import PreparedGraph, prepare
from vtrain_plugin.estimate import predict
from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, DeviceConstants
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.run import RunConfig

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "data"
SINGLE_NODE_CSV = "a100_single_node_calibration.csv"
MULTI_NODE_CSV = "a100_multi_node_calibration.csv"

# How reports name each source of measured runs (MeasuredRun.source).
SOURCE_LABELS = {"single": "vTrain single-node", "multi": "vTrain multi-node", "sc21": "SC'21", "h100": "H100"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    source: str  # "single" or "multi" (vTrain), "sc21" (sc21_data.py) or "h100" (h100_data.py)
    config: dict[str, Any]  # the vTrain config of the run
    measured_ms: float

    @property
    def run(self) -> RunConfig:
        return run_config_from_dict(self.config, source=f"{SOURCE_LABELS[self.source]} row")

    def group(self, name: str) -> Any:
        """The value of one grouping key: tp, pp, dp, micro_batch, hidden, num_gpus or nodes."""
        c = self.config
        return {"tp": c["tensor_parallel_size"], "pp": c["pipeline_parallel_size"],
                "dp": c["data_parallel_size"], "micro_batch": c["micro_batch_size"],
                "hidden": c["hidden_size"], "num_gpus": c["num_gpus"], "nodes": self.source}[name]


def vtrain_config(row: dict[str, str]) -> dict[str, Any]:
    """The vTrain config of one CSV row (both files share these column names)."""
    return {
        "num_gpus": int(row["# GPUs"]),
        "gpu_name": "A100",
        "tensor_parallel_size": int(row["tensor parallelism"]),
        "data_parallel_size": int(row["data parallelism"]),
        "pipeline_parallel_size": int(row["pipeline parallelism"]),
        "global_batch_size": int(row["global batch"]),
        "micro_batch_size": int(row["micro batch"]),
        "num_layers": int(row["# layers"]),
        "hidden_size": int(row["hidden size"]),
        "num_attention_heads": int(row["attention heads"]),
        "max_length": int(row["sequence length"]),
        "vocab_size": None,
        "use_checkpoint": True,
        "use_gradient_bucket": False,
        "inter_node_bandwidth": 1600,
        "intra_node_bandwidth": 300,
        "pipeline_scheduling": "1f1b",
        "node_size": 8,
    }


def read_runs(data_dir: Path = DEFAULT_DATA_DIR, *, which: Sequence[str] = ("single", "multi")) -> list[MeasuredRun]:
    runs: list[MeasuredRun] = []
    for source, name in (("single", SINGLE_NODE_CSV), ("multi", MULTI_NODE_CSV)):
        if source not in which:
            continue
        with open(data_dir / name, newline="") as f:
            for row in csv.DictReader(f):
                runs.append(MeasuredRun(source=source, config=vtrain_config(row),
                                        measured_ms=float(row["iteration time (ms)"])))
    return runs


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR,
                        help=f"folder with the measured runs ({SINGLE_NODE_CSV}, {MULTI_NODE_CSV}, the SC'21 and "
                             f"H100 CSVs; default: {DEFAULT_DATA_DIR})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorStats:
    count: int
    mape: float  # mean absolute percentage error
    median: float  # median absolute % error
    p90: float  # 90th percentile absolute % error
    bias: float  # mean signed % error (positive: overestimate)


def error_stats(predicted: Iterable[float], measured: Iterable[float]) -> ErrorStats:
    p, m = np.asarray(list(predicted), float), np.asarray(list(measured), float)
    err = 100.0 * (p - m) / m
    a = np.abs(err)
    if not len(a):
        return ErrorStats(count=0, mape=math.nan, median=math.nan, p90=math.nan, bias=math.nan)
    return ErrorStats(count=len(a), mape=float(a.mean()), median=float(np.median(a)),
                      p90=float(np.percentile(a, 90)), bias=float(err.mean()))


def grouped(runs: Sequence[MeasuredRun], key: Callable[[MeasuredRun], Any]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for i, r in enumerate(runs):
        out.setdefault(key(r), []).append(i)
    return dict(sorted(out.items(), key=lambda kv: (str(type(kv[0])), kv[0])))


# ---- fast re-estimation: trace and prepare every run once, then re-cost with candidate constants ----

@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRun:
    measured: MeasuredRun
    run: RunConfig
    prepared: PreparedGraph

    def predict_ms(self, constants: DeviceConstants) -> float:
        """What ``vtrain estimate`` prints for this run with ``constants`` as the device's constants."""
        _, result = predict(self.prepared, cluster=self.run.cluster, training=self.run.training, constants=constants)
        return result.iteration_ns / 1e6


def prepare_runs(runs: Sequence[MeasuredRun]) -> list[PreparedRun]:
    out = []
    for m in runs:
        run = m.run
        graph = trace(run.model, run.parallel)
        out.append(PreparedRun(measured=m, run=run, prepared=prepare(graph, run.training.stack_for(
            run.model, get_device(run.cluster.gpu).architecture), fp8=run.training.fp8_settings)))
    return out


def predict_all(prepared: Sequence[PreparedRun], constants: DeviceConstants) -> np.ndarray:
    return np.array([p.predict_ms(constants) for p in prepared])


# ---- the fit ---------------------------------------------------------------------------------------

def within_gemm_ceiling(fitted: dict[str, tuple[float, float, bool]], device: str) -> dict[str, tuple[float, float, bool]]:
    """The search ranges with the GEMM efficiency's top at ``device``'s measured ceiling."""
    ceiling = get_device(device).gemm_ceiling
    if "gemm_efficiency" not in fitted or ceiling is None:
        return fitted
    low, high, log = fitted["gemm_efficiency"]
    return {**fitted, "gemm_efficiency": (low, min(high, ceiling), log)}


# The constants the A100 calibration fits, each searched exactly inside its plausible range
# (vtrain_plugin.hardware.calibration.CONSTANT_RANGES: a bounded fit, never clipped afterwards; the
# GEMM efficiency below the A100's measured ceiling), and whether the search is on a log scale.
FITTED: dict[str, tuple[float, float, bool]] = within_gemm_ceiling({
    name: (*CONSTANT_RANGES[name], log) for name, log in (
        ("gemm_efficiency", False),
        ("hbm_efficiency", False),
        ("kernel_overhead_ns", True),
        ("host_overhead_ns", True),
        ("module_host_overhead_ns", True),
        ("layer_host_overhead_ns", True),
        ("collective_host_overhead_ns", True),
        ("microbatch_overhead_ns", True),
        ("network_efficiency", False),
        ("gpu_speed_spread", False),
    )
}, "a100-sxm4-80gb")


# Constants set from a fitted one rather than fitted themselves (see constants_from_unit).
TIED = ("backward_host_overhead_ns",)


# Where every fit starts: typical values from the documentation of each constant, not from the data.
START = DeviceConstants(gemm_efficiency=0.8, hbm_efficiency=0.8, kernel_overhead_ns=2000.0, host_overhead_ns=5000.0,
                        backward_host_overhead_ns=5000.0, module_host_overhead_ns=20000.0,
                        layer_host_overhead_ns=100_000.0, collective_host_overhead_ns=20000.0, microbatch_overhead_ns=500_000.0, network_efficiency=0.85,
                        gpu_speed_spread=0.01)


def _to_unit(name: str, value: float, fitted: Mapping[str, tuple[float, float, bool]]) -> float:
    low, high, log = fitted[name]
    value = min(max(value, low), high)
    return (math.log(value / low) / math.log(high / low)) if log else (value - low) / (high - low)


def _from_unit(name: str, u: float, fitted: Mapping[str, tuple[float, float, bool]]) -> float:
    low, high, log = fitted[name]
    u = min(max(u, 0.0), 1.0)
    value = low * (high / low) ** u if log else low + u * (high - low)
    return min(max(value, low), high)  # exactly inside the range despite rounding


def constants_from_unit(base: DeviceConstants, u: np.ndarray,
                        fitted: Mapping[str, tuple[float, float, bool]] = FITTED) -> DeviceConstants:
    """Constants at unit-cube point ``u``. Backward kernels get the forward per-kernel host cost:
    dispatch and launch cost the same from autograd's engine (the Python of both directions is the
    per-module cost), and a separate constant is not identifiable from iteration times."""
    values = {name: _from_unit(name, float(x), fitted) for name, x in zip(fitted, u)}
    if "host_overhead_ns" in values:
        values["backward_host_overhead_ns"] = values["host_overhead_ns"]
    return DeviceConstants(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **values})


def log_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute log ratio: symmetric in over- and underestimates, about MAPE/100 when small."""
    return float(np.mean(np.abs(np.log(predicted / measured))))


def fit(prepared: Sequence[PreparedRun], base: DeviceConstants, *, max_evals: int = 1500,
        fitted: Mapping[str, tuple[float, float, bool]] = FITTED,
        log: Callable[[str], None] = lambda s: None) -> tuple[DeviceConstants, float]:
    """Nelder-Mead on the unit cube of :data:`FITTED` (restarted from the best point until it stalls).

    Every source of runs present (vTrain single-node, vTrain multi-node, SC'21, ...) weighs equally
    (the mean of each source's mean error), so the 26 multi-node and the 10 SC'21 runs are not
    drowned by the 144 single-node ones.
    """
    measured = np.array([p.measured.measured_ms for p in prepared])
    sources = [p.measured.source for p in prepared]
    groups = [np.array([s == source for s in sources]) for source in dict.fromkeys(sources)]

    def cost(u: np.ndarray) -> float:
        predicted = predict_all(prepared, constants_from_unit(base, u, fitted))
        return float(np.mean([log_error(predicted[mask], measured[mask]) for mask in groups]))

    x0 = np.array([_to_unit(name, getattr(base, name), fitted) for name in fitted])
    best_x, best_f = x0, cost(x0)
    evals = 1
    step = 0.25
    while evals < max_evals and step > 0.01:
        x, f, used = _nelder_mead(cost, best_x, step, max_evals - evals)
        evals += used
        improved = f < best_f - 1e-6
        if f < best_f:
            best_x, best_f = x, f
        log(f"  restart: error {best_f:.5f} after {evals} evaluations (step {step:.3f})")
        step = step if improved else step / 2
    return constants_from_unit(base, best_x, fitted), best_f


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float, budget: int,
                 tol: float = 1e-6) -> tuple[np.ndarray, float, int]:
    """Plain Nelder-Mead (reflection 1, expansion 2, contraction and shrink 1/2) in [0, 1]^n."""
    n = len(x0)
    clip = lambda x: np.clip(x, 0.0, 1.0)  # noqa: E731
    simplex = [clip(x0)] + [clip(x0 + step * np.eye(n)[i] * (1 if x0[i] < 0.5 else -1)) for i in range(n)]
    values = [f(x) for x in simplex]
    used = n + 1
    while used < budget:
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = clip(centroid + (centroid - simplex[-1]))
        fr = f(reflected)
        used += 1
        if fr < values[0]:
            expanded = clip(centroid + 2 * (centroid - simplex[-1]))
            fe = f(expanded)
            used += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = clip(centroid + 0.5 * (simplex[-1] - centroid))
            fc = f(contracted)
            used += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
                used += n
    i = int(np.argmin(values))
    return simplex[i], values[i], used

"""The measured A100 runs published with vTrain, as vTrain configs and vtrain run configs.

Shared by ``calibrate.py`` and ``published_runs.py``, with the helpers every set's reader and report
uses (:class:`MeasuredRun`, :func:`prepare_runs`, :func:`error_stats`). The calibration CSVs live in
``benchmarks/data`` (override with ``--data DIR``); each row becomes the vTrain
config that describes the measured run (Megatron-DeepSpeed, fp16, full activation recompute, 1F1B,
one gradient all-reduce after the last backward, DGX A100 nodes with 8 x 200 Gb/s InfiniBand).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vtrain_plugin.runs import run_config_from_dict, run_config_from_megatron_args
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cost.prepare import PreparedGraph, prepare_run
from vtrain_plugin.estimate import predict
from vtrain_plugin.hardware.calibration import DeviceConstants
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.run import RunConfig

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "data"
SINGLE_NODE_CSV = "a100_single_node_calibration.csv"
MULTI_NODE_CSV = "a100_multi_node_calibration.csv"

# How reports name each source of measured runs (MeasuredRun.source).
SOURCE_LABELS = {"single": "vTrain single-node", "multi": "vTrain multi-node", "sc21": "SC'21", "h100": "H100",
                 "b200": "NeMo B200", "ci": "Megatron-LM functional tests"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    source: str  # "single" or "multi" (vTrain), "sc21", "h100", "b200" or "ci" (see SOURCE_LABELS)
    config: dict[str, Any]  # the vTrain config (plan mapping) of the run, or its Megatron-LM arguments (ci_data.py)
    measured_ms: float
    name: str = ""  # how reports name the run (its model, its test case)

    @property
    def run(self) -> RunConfig:
        c = self.config
        where = f"{SOURCE_LABELS[self.source]} row {self.name}".rstrip()
        if "megatron_args" in c:
            return run_config_from_megatron_args(c["megatron_args"], gpus=c["gpus"], cluster=cluster_for_gpu(c["gpu"]),
                                                 source=where)
        return run_config_from_dict(c, source=where)

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
    """Every run traced and prepared as ``vtrain estimate`` prepares it (the run's stack and training options)."""
    out = []
    for m in runs:
        run = m.run
        graph = trace(run.model, run.parallel)
        stack = run.training.stack_for(run.model, get_device(run.cluster.gpu).architecture, run.parallel)
        out.append(PreparedRun(measured=m, run=run, prepared=prepare_run(graph, stack, run.training)))
    return out


def predict_all(prepared: Sequence[PreparedRun], constants: DeviceConstants) -> np.ndarray:
    return np.array([p.predict_ms(constants) for p in prepared])

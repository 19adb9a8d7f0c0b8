"""The three published B200 runs (NeMo 25.02, DGX B200, FP8, Megatron-Core + TransformerEngine) as
vtrain plan mappings.

Shared by ``calibrate.py`` and ``published_runs.py``. Each row of
``benchmarks/data/b200_published_calibration.csv`` becomes the plan NeMo's B200 recipe runs (its
``model_configs_b200.csv`` settings, cited per row): bf16 weights with FP8 GEMMs (delayed scaling),
sequence parallelism whenever TP > 1, context parallelism and the interleaved schedule where the row
has them, TransformerEngine's TP communication overlap where the recipe turns it on, no activation
recompute, the distributed optimizer with NeMo's overlap of its gradient reduce-scatter and
parameter all-gather (``h100_data.NEMO_OPTIMIZER``), on DGX B200 nodes. The measured time
is the global batch's tokens over the published tokens/s per GPU times the GPUs. LLAMA3-8B's recipe
uses CUDA graphs, which this plan leaves out (its row's note): at 8,192 tokens per sequence its
kernels are long and the host is idle, so the graphs change little.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR, MeasuredRun
from benchmarks.accuracy.h100_data import NEMO_OPTIMIZER, published_model

B200_CSV = "b200_published_calibration.csv"


def plan_mapping(row: dict[str, str]) -> dict[str, Any]:
    """The plan file (as a mapping) of one published row."""
    tp, pp, cp, vp, gpus = (int(row[k]) for k in ("tp", "pp", "cp", "vp", "gpus"))
    if row["precision"] != "fp8" or row["fp8_recipe"] != "delayed":
        raise ValueError(f"{row['model']}: precision {row['precision']} {row['fp8_recipe']}, this set is FP8 delayed")
    return {
        "model": published_model(row),
        "parallel": {
            "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": vp, "context_parallel": cp,
            "data_parallel": gpus // (tp * pp * cp), "sequence_parallel": tp > 1,
            "micro_batch_size": int(row["micro_batch"]), "recompute": "none",
        },
        "training": {
            "global_batch_size": int(row["global_batch"]),
            "schedule": "interleaved_1f1b" if vp > 1 else "1f1b",
            "software_stack": "megatron_core_te", "fp8": "hybrid", **NEMO_OPTIMIZER,
            "tp_comm_overlap": row["tp_comm_overlap"] == "true" and tp > 1,
        },
        "cluster": {"preset": "dgx-b200"},
    }


def measured_ms(row: dict[str, str]) -> float:
    """One iteration's time from the published throughput: global batch x sequence / (tokens/s/GPU x GPUs)."""
    tokens = int(row["global_batch"]) * int(row["seq_length"])
    return 1000.0 * tokens / (float(row["tokens_per_s_per_gpu"]) * int(row["gpus"]))


def read_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    with open(data_dir / B200_CSV, newline="") as f:
        return [MeasuredRun(source="b200", config=plan_mapping(row), measured_ms=measured_ms(row), name=row["model"])
                for row in csv.DictReader(f)]

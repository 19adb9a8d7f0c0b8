"""The four published H100 runs (NeMo 24.07, DGX H100, FP8, Megatron-Core + TransformerEngine) as
vtrain plan mappings.

Shared by ``calibrate.py`` and ``published_runs.py``. Each row of
``benchmarks/data/h100_published_calibration.csv`` becomes the plan NeMo's recipes run: bf16 weights
with FP8 GEMMs (TransformerEngine hybrid format, delayed scaling), sequence parallelism whenever TP
> 1, the interleaved schedule when the row has virtual stages, no activation recompute, the
distributed optimizer with its gradient reduce-scatter overlapped with the backward pass and its
parameter all-gather with the forward (:data:`NEMO_OPTIMIZER`), TransformerEngine's tensor-parallel
communication overlap whenever TP > 1, on DGX H100 nodes. The measured time is the row's
``iteration_time_s`` (derived from the published tokens/s per GPU).

The H100 rows do not state the overlap; NeMo's recipe settings of the same models one release later
do (``b200_published_calibration.csv``, column ``tp_comm_overlap``, from NeMo v2.3.0's
``model_configs_b200.csv``: true for GPT-3 175B at TP 4 and Llama 3 70B at TP 2, false at TP 1), and
NeMo's performance recipes have overlapped TP communication for these models since they had TP > 1
(inferred, not read for 24.07: no recipe of that release is in the shared data).

Part of the joint calibration (``calibrate.py``): these runs inform the H100's GEMM (here FP8),
fused-attention and HBM efficiencies; its host costs are the stack's, fitted with every set.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR, MeasuredRun

H100_CSV = "h100_published_calibration.csv"
# How NeMo's recipes reduce gradients and step the optimizer (their DistributedDataParallelConfig:
# overlap_grad_reduce, overlap_param_gather; the optimizer: use_distributed_optimizer). Memory says
# the same: without the distributed optimizer's sharding no published H100 or B200 run fits its GPU
# (vtrain's peak 125-256 GiB on 80 and 180 GB; with it 67-149 GiB), yet every one of them ran.
NEMO_OPTIMIZER = {"grad_reduce": "overlap", "distributed_optimizer": True, "overlap_param_gather": True}


def published_model(row: dict[str, str]) -> dict[str, Any]:
    """The model section of a published NeMo row (the H100 and B200 sets share the columns)."""
    return {
        "name": row["model"], "family": row["family"], "num_layers": int(row["num_layers"]),
        "hidden_size": int(row["hidden_size"]), "num_attention_heads": int(row["num_attention_heads"]),
        "num_query_groups": int(row["num_query_groups"]), "ffn_hidden_size": int(row["ffn_hidden_size"]),
        "seq_length": int(row["seq_length"]), "vocab_size": int(row["vocab_size"]), "dtype": "bf16",
    }


def plan_mapping(row: dict[str, str]) -> dict[str, Any]:
    """The plan file (as a mapping) of one published row."""
    tp, pp, vp = int(row["tp"]), int(row["pp"]), int(row["vp"])
    gpus = int(row["gpus"])
    if int(row["cp"]) != 1:
        raise ValueError(f"{row['model']}: context parallelism is not part of this calibration set")
    return {
        "model": published_model(row),
        "parallel": {
            "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": vp,
            "data_parallel": gpus // (tp * pp), "sequence_parallel": tp > 1,
            "micro_batch_size": int(row["micro_batch"]), "recompute": "none",
        },
        "training": {
            "global_batch_size": int(row["global_batch"]),
            "schedule": "interleaved_1f1b" if vp > 1 else "1f1b",
            "software_stack": "megatron_core_te", "fp8": "hybrid", **NEMO_OPTIMIZER,
            "tp_comm_overlap": tp > 1,
        },
        "cluster": {"preset": "dgx-h100"},
    }


def read_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    with open(data_dir / H100_CSV, newline="") as f:
        return [MeasuredRun(source="h100", config=plan_mapping(row), measured_ms=1000.0 * float(row["iteration_time_s"]),
                            name=row["model"])
                for row in csv.DictReader(f)]

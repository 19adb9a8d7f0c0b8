"""The ten runs of Narayanan et al. (SC'21) Table 1 as vtrain plan mappings: large-scale A100 data.

Shared by ``calibrate.py a100-sxm4-80gb megatron_deepspeed_2023`` and ``published_runs.py``. Each row of
``benchmarks/data/a100_published_megatron_sc21.csv`` (GPT 1.7B to 1T on 32 to 3,072 A100 80GB) becomes
the plan Megatron-LM of 2021 ran: fp16, full activation recompute, no sequence parallelism, no
distributed optimizer, one gradient all-reduce after the last backward (that Megatron-LM did not yet
overlap it), on DGX A100 nodes with 8 x 200 Gb/s HDR InfiniBand. A row with
``layers_per_virtual_stage`` ran the interleaved 1F1B schedule with ``num_layers / (pp x
layers_per_virtual_stage)`` model chunks per pipeline rank. The kernels are those of the vTrain runs
(apex LayerNorm, fused scaled-masked softmax, fp16 GEMMs), so the software stack is
``megatron_deepspeed_2023`` and all A100 data share one calibration file. The measured time is the
row's ``iteration_time_s`` (derived from the published TFLOP/s per GPU with the paper's FLOP formula).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from benchmarks.accuracy import a100_data
from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR, MeasuredRun

SC21_CSV = "a100_published_megatron_sc21.csv"


def virtual_pipeline(row: dict[str, str]) -> int:
    """Model chunks per pipeline rank: Megatron's ``--num-layers-per-virtual-pipeline-stage`` turned
    into vtrain's ``virtual_pipeline`` (1 when the row is not interleaved)."""
    if not row["layers_per_virtual_stage"]:
        return 1
    layers, pp, per_stage = int(row["num_layers"]), int(row["pp"]), int(row["layers_per_virtual_stage"])
    if layers % (pp * per_stage):
        raise ValueError(f"{row['model']}: num_layers ({layers}) is not divisible by pp ({pp}) * "
                         f"layers_per_virtual_stage ({per_stage}) = {pp * per_stage}")
    return layers // (pp * per_stage)


def plan_mapping(row: dict[str, str]) -> dict[str, Any]:
    """The plan file (as a mapping) of one row of Table 1."""
    tp, pp, dp, gpus = int(row["tp"]), int(row["pp"]), int(row["dp"]), int(row["gpus"])
    if tp * pp * dp != gpus:
        raise ValueError(f"{row['model']}: tp ({tp}) * pp ({pp}) * dp ({dp}) = {tp * pp * dp} != gpus ({gpus})")
    if row["recompute"] != "full":
        raise ValueError(f"{row['model']}: recompute {row['recompute']!r}, this set is full recompute only")
    vp = virtual_pipeline(row)
    return {
        "model": {
            "name": row["model"], "family": "gpt", "num_layers": int(row["num_layers"]),
            "hidden_size": int(row["hidden_size"]), "num_attention_heads": int(row["num_attention_heads"]),
            "seq_length": int(row["seq_length"]), "vocab_size": int(row["vocab_size"]), "dtype": "fp16",
        },
        "parallel": {
            "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": vp, "data_parallel": dp,
            "sequence_parallel": False, "micro_batch_size": int(row["micro_batch"]), "recompute": "full",
        },
        "training": {
            "global_batch_size": int(row["global_batch"]),
            "schedule": "interleaved_1f1b" if vp > 1 else "1f1b",
            "grad_reduce": "after_backward", "software_stack": "megatron_deepspeed_2023",
        },
        "cluster": {"preset": "dgx-a100"},
    }


def read_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    with open(data_dir / SC21_CSV, newline="") as f:
        return [MeasuredRun(source="sc21", config=plan_mapping(row), measured_ms=1000.0 * float(row["iteration_time_s"]),
                            name=row["model"])
                for row in csv.DictReader(f)]


def joint_a100_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    """Every measured A100 run of the megatron_deepspeed_2023 stack, the joint calibration set:
    vTrain's single- and multi-node runs (up to 64 GPUs) and SC'21's (up to 3,072)."""
    return a100_data.read_runs(data_dir) + read_runs(data_dir)

"""The four published H100 runs (NeMo 24.07, DGX H100, FP8, Megatron-Core + TransformerEngine) as
vtrain plan mappings, and the H100 calibration's rules.

Shared by ``calibrate.py h100-sxm megatron_core_te`` and ``published_runs.py``. Each row of
``benchmarks/data/h100_published_calibration.csv`` becomes the plan NeMo's recipes run: bf16 weights
with FP8 GEMMs (TransformerEngine hybrid format, delayed scaling), sequence parallelism whenever TP
> 1, the interleaved schedule when the row has virtual stages, no activation recompute, gradient
reduction overlapped with the backward pass, on DGX H100 nodes. The measured time is the row's
``iteration_time_s`` (derived from the published tokens/s per GPU).

What is fitted here (at most three H100-specific constants, each bounded to its documented range):
the GEMM efficiency (here of FP8 GEMMs), the fused-attention efficiency and the HBM efficiency. Every
host cost (per kernel, module call, TP collective, layer, micro-batch), the kernel overhead and the
network efficiency are software or platform constants and are transferred from the A100 fit: host
costs per module do not change with the GPU.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR, MeasuredRun, within_gemm_ceiling

from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, DeviceConstants, calibration_for

H100_CSV = "h100_published_calibration.csv"

# Each bounded to its documented range, the GEMM efficiency below the H100's measured ceiling.
FITTED_H100: dict[str, tuple[float, float, bool]] = within_gemm_ceiling({
    name: (*CONSTANT_RANGES[name], False) for name in ("gemm_efficiency", "attention_efficiency", "hbm_efficiency")
}, "h100-sxm")


def plan_mapping(row: dict[str, str]) -> dict[str, Any]:
    """The plan file (as a mapping) of one published row."""
    tp, pp, vp = int(row["tp"]), int(row["pp"]), int(row["vp"])
    gpus = int(row["gpus"])
    if int(row["cp"]) != 1:
        raise ValueError(f"{row['model']}: context parallelism is not part of this calibration set")
    return {
        "model": {
            "name": row["model"], "family": row["family"], "num_layers": int(row["num_layers"]),
            "hidden_size": int(row["hidden_size"]), "num_attention_heads": int(row["num_attention_heads"]),
            "num_query_groups": int(row["num_query_groups"]), "ffn_hidden_size": int(row["ffn_hidden_size"]),
            "seq_length": int(row["seq_length"]), "vocab_size": int(row["vocab_size"]), "dtype": "bf16",
        },
        "parallel": {
            "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": vp,
            "data_parallel": gpus // (tp * pp), "sequence_parallel": tp > 1,
            "micro_batch_size": int(row["micro_batch"]), "recompute": "none",
        },
        "training": {
            "global_batch_size": int(row["global_batch"]),
            "schedule": "interleaved_1f1b" if vp > 1 else "1f1b",
            "grad_reduce": "overlap", "software_stack": "megatron_core_te", "fp8": "hybrid",
        },
        "cluster": {"preset": "dgx-h100"},
    }


def read_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    with open(data_dir / H100_CSV, newline="") as f:
        return [MeasuredRun(source="h100", config=plan_mapping(row), measured_ms=1000.0 * float(row["iteration_time_s"]))
                for row in csv.DictReader(f)]


def start_constants() -> DeviceConstants:
    """Where the H100 fit starts: the A100 fit's software and platform constants, the spec-derived
    H100 defaults for the three device constants (the shipped uncalibrated file)."""
    a100 = calibration_for("a100-sxm4-80gb", "megatron_deepspeed_2023").constants
    defaults = calibration_for("h100-sxm", "default").constants
    return DeviceConstants(
        gemm_efficiency=defaults.gemm_efficiency, hbm_efficiency=defaults.hbm_efficiency, attention_efficiency=0.55,
        kernel_overhead_ns=a100.kernel_overhead_ns, host_overhead_ns=a100.host_overhead_ns,
        backward_host_overhead_ns=a100.backward_host_overhead_ns, module_host_overhead_ns=a100.module_host_overhead_ns,
        layer_host_overhead_ns=a100.layer_host_overhead_ns,
        collective_host_overhead_ns=a100.collective_host_overhead_ns,
        microbatch_overhead_ns=a100.microbatch_overhead_ns, network_efficiency=a100.network_efficiency,
        gpu_speed_spread=a100.gpu_speed_spread)

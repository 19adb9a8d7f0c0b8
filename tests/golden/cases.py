"""The headline numbers pinned by the golden tests, and how to compute them.

Each case is a run description (a plan file or vTrain config, as a user writes it) estimated through
the public API exactly as ``vtrain estimate`` does; :func:`observe` reduces an estimate to the
numbers that must not move without a reason: iteration time, the breakdown of every pipeline stage,
MFU and memory per stage. ``values.json`` beside this file holds them.

A change that moves a golden says why in its commit and rewrites the file with
``.venv/bin/python -m tests.golden.cases --write`` (run from the repository root).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VALUES = Path(__file__).with_name("values.json")


def _vtrain_row(num_gpus: int, global_batch: int, micro_batch: int, hidden: int, heads: int, layers: int,
                seq: int, tp: int, dp: int, pp: int) -> dict[str, Any]:
    """A row of the published A100 calibration data as the vTrain config that describes the run."""
    return {"num_gpus": num_gpus, "gpu_name": "A100", "tensor_parallel_size": tp, "data_parallel_size": dp,
            "pipeline_parallel_size": pp, "global_batch_size": global_batch, "micro_batch_size": micro_batch,
            "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "max_length": seq,
            "vocab_size": None, "use_checkpoint": True, "use_gradient_bucket": False,
            "inter_node_bandwidth": 1600, "intra_node_bandwidth": 300, "pipeline_scheduling": "1f1b",
            "node_size": 8}


# Rows of benchmarks/data/a100_{single,multi}_node_calibration.csv (inputs only; the measured times
# are not needed to pin the prediction).
A100_ROWS: dict[str, dict[str, Any]] = {
    "a100_single_tp4_pp2_mb2": _vtrain_row(8, 4, 2, 1024, 16, 24, 1024, 4, 1, 2),
    "a100_single_tp2_pp2_mb8": _vtrain_row(4, 16, 8, 1024, 16, 24, 1024, 2, 1, 2),
    "a100_single_tp2_pp1_mb1": _vtrain_row(2, 8, 1, 2048, 16, 24, 1024, 2, 1, 1),
    "a100_single_tp8_pp1_mb4": _vtrain_row(8, 16, 4, 4096, 32, 8, 2048, 8, 1, 1),
    "a100_multi_dp64_mb8": _vtrain_row(64, 512, 8, 3072, 32, 30, 2048, 1, 64, 1),
    "a100_multi_tp8_pp2_dp4": _vtrain_row(64, 512, 4, 4096, 32, 16, 2048, 8, 4, 2),
}

# Interleaved 1F1B with sequence parallelism, selective recompute and overlapped, bucketed gradient
# reduction: a Llama-style plan file on DGX H100 nodes.
LLAMA_INTERLEAVED = """
model: {name: llama-golden, family: llama, num_layers: 8, hidden_size: 1024, num_attention_heads: 16,
        num_query_groups: 4, seq_length: 1024, vocab_size: 32000, dtype: bf16}
parallel: {tensor_parallel: 2, pipeline_parallel: 2, data_parallel: 4, sequence_parallel: true,
           virtual_pipeline: 2, micro_batch_size: 1, recompute: selective}
training: {global_batch_size: 32, schedule: interleaved_1f1b, grad_reduce: overlap, bucket_size_mb: 8}
cluster: {preset: dgx-h100}
"""


def cases(tmp: Path) -> dict[str, Path]:
    """Every golden case as a file a user would pass to ``vtrain estimate``."""
    configs = REPO / "examples" / "configs"
    files = {"gpt3_175b_512gpu": configs / "gpt3_175b_512gpu.json",
             # the README's Llama 3 70B on 256 H100 with Megatron-Core + TransformerEngine, bf16 and FP8
             "llama3_70b_256gpu_bf16": configs / "llama3_70b_256gpu_bf16.yaml",
             "llama3_70b_256gpu_fp8": configs / "llama3_70b_256gpu_fp8.yaml"}
    for name, row in A100_ROWS.items():
        files[name] = tmp / f"{name}.json"
        files[name].write_text(json.dumps(row))
    files["llama_interleaved_sp_selective"] = tmp / "llama_interleaved_sp_selective.yaml"
    files["llama_interleaved_sp_selective"].write_text(LLAMA_INTERLEAVED)
    return files


def observe(path: Path) -> dict[str, Any]:
    from vtrain_plugin.runs import load_run_config
    from vtrain_plugin.estimate import estimate

    est = estimate(load_run_config(path))
    return {
        "iteration_time_ms": est.iteration_time_ms,
        "mfu": est.mfu,
        "stage_breakdown_ms": [dict(stage) for stage in est.stage_breakdown_ms],
        "memory_gib": [m.to_dict() for m in est.memory_gib],
    }


def observe_all() -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return {name: observe(path) for name, path in cases(Path(tmp)).items()}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {VALUES.name} with the current numbers")
    args = parser.parse_args()
    values = observe_all()
    text = json.dumps(values, indent=1, sort_keys=True) + "\n"
    if args.write:
        VALUES.write_text(text)
        print(f"wrote {len(values)} golden cases to {VALUES}")
    else:
        print(text)


if __name__ == "__main__":
    main()

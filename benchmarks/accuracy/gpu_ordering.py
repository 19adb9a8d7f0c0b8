"""One plan, one answer per GPU: the same bf16 plans (Megatron-Core + TransformerEngine) on A100,
H100, H200 and B200, each on its GPU's usual node. Prints the table of README "One plan, one answer
per GPU"; ``tests/integration/test_gpu_ordering.py`` holds a wider grid to B200 <= H200 <= H100 <= A100.

    .venv/bin/python -m benchmarks.accuracy.gpu_ordering
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]

from vtrain_plugin.runs import load_run_config, run_config_from_dict, with_gpu
from vtrain_plugin.estimate import estimate

GPUS = {"A100": "a100-sxm4-80gb", "H100": "h100-sxm", "H200": "h200-sxm", "B200": "b200-sxm"}
GPT_1B = {"name": "gpt-1.3b", "family": "gpt", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
          "seq_length": 2048, "vocab_size": 50257, "dtype": "bf16"}
GPT_TINY = {"name": "gpt-tiny", "family": "gpt", "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
            "seq_length": 512, "vocab_size": 8192, "dtype": "bf16"}


def _plan(model: dict, global_batch: int, **parallel) -> dict:
    return {"model": model, "parallel": parallel, "cluster": {"preset": "dgx-a100"},
            "training": {"global_batch_size": global_batch, "software_stack": "megatron_core_te"}}


PLANS = {
    "GPT 24 layers, hidden 2048, 8 GPUs, micro-batch 4": _plan(GPT_1B, 512, data_parallel=8, micro_batch_size=4),
    "the same, micro-batch 1, full recompute": _plan(GPT_1B, 512, data_parallel=8, micro_batch_size=1,
                                                     recompute="full"),
    "GPT 4 layers, hidden 512, 1 GPU": _plan(GPT_TINY, 8, micro_batch_size=4),
}


def main() -> None:
    runs = {name: run_config_from_dict(plan, source=name) for name, plan in PLANS.items()}
    runs["Llama 3 70B, 256 GPUs (examples/configs/llama3_70b_256gpu_bf16.yaml)"] = load_run_config(
        REPO / "examples/configs/llama3_70b_256gpu_bf16.yaml")
    rows = []
    for name, run in runs.items():
        estimates = {gpu: estimate(with_gpu(run, device)) for gpu, device in GPUS.items()}
        rows.append({"plan": name, **{f"{gpu} ms": round(e.iteration_time_ms, 2) for gpu, e in estimates.items()},
                     **{f"{gpu} MFU %": round(100 * e.mfu, 1) for gpu, e in estimates.items()}})
    with pd.option_context("display.width", 250, "display.max_columns", None):
        print(pd.DataFrame(rows).set_index("plan").to_string())


if __name__ == "__main__":
    main()

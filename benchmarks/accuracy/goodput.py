"""What a run really costs: Llama-3-70B-style and 405B-style runs on 1,024 and 16,384 H100, without
failures, with Llama 3's failure rate and synchronous checkpoints, and with asynchronous ones (the
checkpoint interval each time Daly's optimum). Prints the table of README "What a run really costs".

    .venv/bin/python -m benchmarks.accuracy.goodput
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]

from vtrain_plugin.runs import load_run_config
from vtrain_plugin.estimate import Estimate, estimate
from vtrain_plugin.specs.reliability import CheckpointMode, ReliabilitySpec
from vtrain_plugin.specs.run import RunConfig

TOKENS = 15e12  # Llama 3's pre-training corpus, about 15 trillion tokens
GLOBAL_BATCH = 2048  # sequences of 8192 tokens: 16M tokens per iteration, as Llama 3 405B ended with


def llama3_70b(gpus: int) -> RunConfig:
    """The README's Llama 3 70B plan at TP 8 without context parallelism (distributed optimizer) on
    ``gpus`` GPUs."""
    run = load_run_config(REPO / "examples/configs/llama3_70b_256gpu_bf16.yaml")
    parallel = replace(run.parallel, tensor_parallel=8, context_parallel=1, data_parallel=gpus // 32)
    return replace(run, parallel=parallel, training=replace(run.training, global_batch_size=GLOBAL_BATCH,
                                                            distributed_optimizer=True, total_tokens=TOKENS))


def llama3_405b(gpus: int) -> RunConfig:
    """Meta's Llama 3 405B layout (TP 8, PP 16) on ``gpus`` GPUs."""
    run = load_run_config(REPO / "examples/configs/llama3_405b_16384gpu.yaml")
    return replace(run, parallel=replace(run.parallel, data_parallel=gpus // 128),
                   training=replace(run.training, total_tokens=TOKENS))


SLOW_STORAGE_GBYTES_PER_S = 100.0  # a what-if: a file system fifty times slower than Llama 3's


def rows() -> list[dict]:
    out = []
    for name, build in (("Llama-3-70B", llama3_70b), ("Llama-3-405B", llama3_405b)):
        for gpus in (1024, 16384):
            est = estimate(build(gpus))
            for storage in (None, SLOW_STORAGE_GBYTES_PER_S):
                out.append(_row(name, gpus, est, storage))
    return out


def _row(name: str, gpus: int, est: Estimate, storage: float | None) -> dict:
    base = ReliabilitySpec() if storage is None else ReliabilitySpec(storage_write_gbytes_per_s_total=storage,
                                                                     storage_read_gbytes_per_s_total=storage)
    sync = est.train_totals(reliability=base)
    asynchronous = est.train_totals(reliability=replace(base, checkpoint=CheckpointMode.ASYNC))
    f = sync.failures
    return {
        "model": name, "GPUs": gpus,
        "storage GB/s": min(gpus // 8 * base.storage_write_gbytes_per_s_per_node,
                                base.storage_write_gbytes_per_s_total),
        "iteration s": est.iteration_time_ms / 1e3,
        "days, no failures": sync.ideal_days, "$M, no failures": sync.ideal_cost_usd / 1e6,
        "one failure every (h)": f.mtbf_hours, "failures": f.run.failures,
        "checkpoint GB": f.checkpoint_nbytes / 1e9, "write s": f.checkpoint.write_s,
        "sync: days": sync.days, "sync: $M": sync.cost_usd / 1e6, "sync: goodput %": 100 * sync.goodput,
        "sync: every (it)": f.interval_iterations,
        "async: days": asynchronous.days, "async: goodput %": 100 * asynchronous.goodput,
        "async: every (it)": asynchronous.failures.interval_iterations,
        "restarts %": 100 * f.run.restart_s / f.run.wall_s,
    }


def main() -> None:
    table = pd.DataFrame(rows())
    print(f"{TOKENS:.3g} tokens, global batch {GLOBAL_BATCH} x 8192, H100 (dgx-h100), reliability defaults "
          f"(large-scale failure rate, 10 min restarts, storage 25 GB/s per node and 2 TB/s in total; second row "
          f"of each: {SLOW_STORAGE_GBYTES_PER_S:g} GB/s in total)\n")
    print(markdown(table))


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table, numbers to three significant digits."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""vTrain's first case study: which (TP, DP, PP) plan should MT-NLG 530B have used?

MT-NLG 530B (105 layers, hidden 20480, 128 heads, sequence 2048, fp16) with a global batch of 1920
on DGX A100 80GB nodes, TP in {4, 8, 16}, DP in {1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, 24, 30},
PP in {3, 5, 7, 15, 21, 35, 105}, micro-batch 1 and full recompute (the paper's space). Writes every
evaluated plan (CSV) and the time-versus-cost plot, prints the best plan per GPU count and where
MT-NLG's own plan (TP 8, DP 12, PP 35 on 3,360 GPUs) sits against the Pareto front.

Run: ``.venv/bin/python examples/mtnlg_plans.py [--out DIR] [--workers N]`` (a few minutes on two
cores, most of it tracing the three TP sizes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.plot import plot_search
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace, format_skipped
from vtrain_plugin.specs.model import ModelSpec

MT_NLG = ModelSpec(name="mt-nlg-530b", num_layers=105, hidden_size=20480, num_attention_heads=128,
                   seq_length=2048, vocab_size=51200, dtype="fp16")
GLOBAL_BATCH = 1920
SPACE = SearchSpace(tensor_parallel=(4, 8, 16), data_parallel=(1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, 24, 30),
                    pipeline_parallel=(3, 5, 7, 15, 21, 35, 105), micro_batch_size=(1,), virtual_pipeline=(1,),
                    sequence_parallel=(False,), recompute=("full",), grad_reduce=("after_backward",),
                    distributed_optimizer=(False,), max_tp=16)
PRODUCTION = {"tensor_parallel": 8, "data_parallel": 12, "pipeline_parallel": 35}
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the CSV and the plot ({RESULTS})")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    args = parser.parse_args()
    cluster = get_cluster_preset("dgx-a100")
    result = search(MT_NLG, cluster=cluster, global_batch_size=GLOBAL_BATCH, gpus="1:100000", space=SPACE,
                    objective="time", workers=args.workers, progress=True)
    table = result.table
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "mtnlg_plans.csv", table.to_csv(index=False))
    production = table[(table[list(PRODUCTION)] == list(PRODUCTION.values())).all(axis=1)].iloc[0]
    plot_search(result, args.out / "mtnlg_plans.png", baseline=production.to_dict(),
                baseline_label="MT-NLG (8, 12, 35)", title=f"MT-NLG 530B: {len(table)} plans on DGX A100")

    fitting = table[table["fits_in_memory"]]
    best = fitting.sort_values("iteration_time_ms", kind="stable").groupby("num_gpus", sort=True).head(1)
    rows = [[f"{r.num_gpus:,}", f"({r.tensor_parallel}, {r.data_parallel}, {r.pipeline_parallel})",
             f"{r.iteration_time_ms / 1000:.2f}", f"{100 * r.mfu:.1f}%", f"{r.peak_memory_gib:.1f}",
             f"${r.cost_usd:,.0f}", "*" if r.pareto else ""] for r in best.sort_values("num_gpus").itertuples()]
    print(render_table(rows, ["GPUs", "best (TP, DP, PP)", "iteration s", "MFU", "memory GiB", "$/iteration",
                              "front"]))
    print()
    skipped = sum(result.skipped.values())
    print(f"{len(table)} plans evaluated, {len(fitting)} fit in 80 GB, {int(table['pareto'].sum())} on the front, "
          f"{skipped} skipped" + (f" ({format_skipped(result.skipped)})" if skipped else ""))
    dominating = fitting[(fitting["iteration_time_ms"] <= production["iteration_time_ms"])
                         & (fitting["cost_usd"] <= production["cost_usd"])
                         & ((fitting["iteration_time_ms"] < production["iteration_time_ms"])
                            | (fitting["cost_usd"] < production["cost_usd"]))]
    print(f"MT-NLG's own plan (8, 12, 35) on {production['num_gpus']:,} GPUs: "
          f"{production['iteration_time_ms'] / 1000:.2f} s and ${production['cost_usd']:,.0f} per iteration, "
          f"{100 * production['mfu']:.1f}% MFU, {production['peak_memory_gib']:.1f} GiB, "
          f"{'on' if production['pareto'] else 'off'} the front, rank {int(production['rank'])} by time")
    for r in dominating.sort_values("cost_usd").head(5).itertuples():
        print(f"  dominated by ({r.tensor_parallel}, {r.data_parallel}, {r.pipeline_parallel}) on {r.num_gpus:,} "
              f"GPUs: {r.iteration_time_ms / 1000:.2f} s ({r.iteration_time_ms / production['iteration_time_ms'] - 1:+.1%}),"
              f" ${r.cost_usd:,.0f} ({r.cost_usd / production['cost_usd'] - 1:+.1%})")
    print(f"wrote {args.out / 'mtnlg_plans.csv'} and {args.out / 'mtnlg_plans.png'}")


if __name__ == "__main__":
    main()

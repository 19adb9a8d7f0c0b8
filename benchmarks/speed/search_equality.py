"""Search rows against one-plan estimates: sampled plans of dense, MoE, MLA and hybrid model spaces.

For each model kind, ``search()`` runs over a small space; sampled rows are each rebuilt as the plan
file of that plan (model, parallel, training and cluster sections, as ``vtrain estimate`` reads one)
and estimated on their own. Every time, memory and cost column must be equal: the tolerance is zero
(a search row is that plan's estimate, not an approximation of it), NaN equal to NaN. The mismatches
are printed as a table, and the exit code is 1 when there is any. Then one fixed warm search (the
dense space, its traces cached by the comparison) runs with one worker, two local worker processes
and, when Ray is installed, two Ray workers: wall time, CPU seconds (this process and its reaped
workers) and whether the table equals the one-worker table.

Why: the search may cost its plans in arrays and in worker processes; this checks that it still
answers what a user asking about one plan is told. Small models keep it to minutes (the traces are
the cost). Run with ``.venv/bin/python -m benchmarks.speed.search_equality [--per-kind N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vtrain_plugin.capture.tracer import clear_cache
from vtrain_plugin.cli.render import render_table
from vtrain_plugin.estimate import Estimate, estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace
from vtrain_plugin.runs import run_config_from_dict
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.plan_file import plan_document
from vtrain_plugin.specs.training import GradReduce, ScheduleKind, TrainingSpec

CLUSTER = get_cluster_preset("dgx-h100")
GLOBAL_BATCH = 32
_SMALL = dict(hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=2048, dtype="bf16")
# Small stand-ins of the four kinds: every layer kind megatron-core builds for them, at toy sizes.
MODELS = {
    "dense": ModelSpec(name="llama-like", family="llama", num_layers=4, num_query_groups=4, ffn_hidden_size=704,
                       **_SMALL),
    "moe": ModelSpec(name="qwen3-moe-like", family="llama", num_layers=4, num_query_groups=4, qk_layernorm=True,
                     num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, **_SMALL),
    "mla": ModelSpec(name="deepseek-like", family="llama", num_layers=4, ffn_hidden_size=704,
                     multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32,
                     qk_pos_emb_head_dim=16, v_head_dim=32, num_experts=8, moe_router_topk=2,
                     moe_ffn_hidden_size=256, moe_shared_expert_intermediate_size=256, **_SMALL),
    "hybrid": ModelSpec(name="nemotron-h-like", family="gpt", num_layers=6, hybrid_layer_pattern="M*-M-M",
                        mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=2, ffn_hidden_size=1024,
                        **_SMALL),
}
# The layouts each kind is searched over (GPU counts 4, 8 and 16): every pair of TP and PP sizes
# up to 2 and their SP, micro-batch and recompute variants, times the DP, VP, gradient-reduction and
# distributed-optimizer choices that share their traces.
SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1, 2),
                    recompute=("none", "full"), software_stack=("megatron_core_te",), fp8=(None,))
GPUS = "4,8,16"
EXPERT_SPACE = {"moe": (1, 2), "mla": (1, 2)}  # expert-parallel sizes of the kinds with experts
# The estimate's columns of a search row that are the estimate's own numbers (time, memory, cost).
COMPARED = ("num_gpus", "num_microbatches", "iteration_time_ms", "iteration_time_low_ms", "iteration_time_high_ms",
            "tokens_per_second", "tflops_per_gpu", "mfu", "peak_memory_gib", "fits_in_memory", "cost_usd")


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatch:
    kind: str
    plan: str
    column: str
    search_value: Any
    estimate_value: Any


def space_of(kind: str, space: SearchSpace = SPACE) -> SearchSpace:
    return replace(space, expert_parallel=EXPERT_SPACE.get(kind, (1,)))


def plan_of(row: Mapping[str, Any], base: TrainingSpec) -> tuple[ParallelPlan, TrainingSpec]:
    """The plan a search row describes, as a user would write it in a plan file: the row's layout and
    training choices; the parameter all-gather overlapped when the gradients are (the search's rule
    for the distributed optimizer)."""
    parallel = ParallelPlan(
        tensor_parallel=int(row["tensor_parallel"]), context_parallel=int(row["context_parallel"]),
        pipeline_parallel=int(row["pipeline_parallel"]), data_parallel=int(row["data_parallel"]),
        expert_parallel=int(row["expert_parallel"]), micro_batch_size=int(row["micro_batch_size"]),
        virtual_pipeline=int(row["virtual_pipeline"]), sequence_parallel=bool(row["sequence_parallel"]),
        recompute=row["recompute"])
    grad_reduce = GradReduce(row["grad_reduce"])
    distributed = bool(row["distributed_optimizer"])
    training = replace(base, schedule=ScheduleKind(row["schedule"]), grad_reduce=grad_reduce,
                       distributed_optimizer=distributed, software_stack=row["software_stack"],
                       overlap_param_gather=distributed and grad_reduce is GradReduce.OVERLAP)
    return parallel, training


def one_plan(model: ModelSpec, parallel: ParallelPlan, training: TrainingSpec, cluster: ClusterSpec) -> Estimate:
    """``vtrain estimate`` of the plan file of these specs (read back as the CLI reads a file)."""
    run = run_config_from_dict(plan_document(model, parallel, training, cluster.to_dict()), source="sampled plan")
    return estimate(run, profile_db=False)


def estimate_values(est: Estimate) -> dict[str, Any]:
    low, high = est.iteration_time_band_ms or (math.nan, math.nan)
    return {"num_gpus": est.num_gpus, "num_microbatches": est.num_microbatches,
            "iteration_time_ms": est.iteration_time_ms, "iteration_time_low_ms": low, "iteration_time_high_ms": high,
            "tokens_per_second": est.tokens_per_second, "tflops_per_gpu": est.tflops_per_gpu, "mfu": est.mfu,
            "peak_memory_gib": est.peak_memory_gib, "fits_in_memory": est.fits_in_memory,
            "cost_usd": math.nan if est.cost_usd is None else est.cost_usd}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def describe(row: Mapping[str, Any]) -> str:
    return (f"tp {row['tensor_parallel']} pp {row['pipeline_parallel']} dp {row['data_parallel']} "
            f"ep {row['expert_parallel']} vp {row['virtual_pipeline']} mb {row['micro_batch_size']} "
            f"sp {'on' if row['sequence_parallel'] else 'off'} rc {row['recompute']} {row['grad_reduce']}"
            f"{' dist-opt' if row['distributed_optimizer'] else ''}")


def compare_kind(kind: str, *, sample: int, seed: int, space: SearchSpace = SPACE, gpus: str = GPUS,
                 workers: int = 1) -> tuple[int, int, list[Mismatch]]:
    """(plans searched, plans compared, mismatches) of ``sample`` rows of ``kind``'s search."""
    model = MODELS[kind]
    base = TrainingSpec(global_batch_size=GLOBAL_BATCH)
    result = search(model, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=gpus, space=space_of(kind, space),
                    training=base, workers=workers, profile_db=False)
    rows = result.table.to_dict("records")
    chosen = random.Random(f"{seed}-{kind}").sample(rows, min(sample, len(rows)))
    mismatches = []
    for row in chosen:
        parallel, training = plan_of(row, base)
        alone = estimate_values(one_plan(model, parallel, training, CLUSTER))
        mismatches += [Mismatch(kind=kind, plan=describe(row), column=column, search_value=row[column],
                                estimate_value=alone[column])
                       for column in COMPARED if not _equal(_plain(row[column]), alone[column])]
    return len(rows), len(chosen), mismatches


def _plain(value: Any) -> Any:
    """A pandas cell as the Python value (numpy scalars to int, float, bool)."""
    return value.item() if hasattr(value, "item") else value


def mismatch_table(mismatches: Sequence[Mismatch]) -> str:
    return render_table([[m.kind, m.plan, m.column, repr(m.search_value), repr(m.estimate_value)] for m in mismatches],
                        ["kind", "plan", "column", "search row", "one-plan estimate"])


def backend_rows(kind: str = "dense") -> list[list[str]]:
    """One warm search of ``kind``'s space per backend and worker count: wall s, CPU s, same table."""
    model = MODELS[kind]
    try:
        import ray  # noqa: F401
        cases = [("local", 1), ("local", 2), ("ray", 2)]
    except ImportError:
        cases = [("local", 1), ("local", 2)]
    rows, reference = [], None
    for backend, workers in cases:
        clear_cache()  # every case reads the traces from the disk cache, as worker processes do
        before = _cpu_s()
        start = time.perf_counter()
        table = search(model, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=GPUS, space=space_of(kind),
                       workers=workers, backend=backend, profile_db=False).table
        wall = time.perf_counter() - start
        cpu = _cpu_s() - before
        reference = table if reference is None else reference
        rows.append([backend, str(workers), str(len(table)), f"{wall:.2f}", f"{cpu:.2f}",
                     "yes" if table.equals(reference) else "NO"])
    if len(cases) == 2:
        rows.append(["ray", "2", "-", "-", "-", "not installed (pip install vtrain[ray]): skipped"])
    return rows


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the search's worker processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--per-kind", type=int, default=60, help="plans sampled per model kind (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="search worker processes (default 1)")
    args = parser.parse_args()
    rows, everything = [], []
    for kind in MODELS:
        start_cpu, start = time.process_time(), time.perf_counter()
        searched, compared, mismatches = compare_kind(kind, sample=args.per_kind, seed=args.seed, workers=args.workers)
        rows.append([kind, MODELS[kind].name, str(searched), str(compared), str(len(mismatches)),
                     f"{time.perf_counter() - start:.0f}", f"{time.process_time() - start_cpu:.0f}"])
        everything += mismatches
    print(render_table(rows, ["kind", "model", "plans searched", "plans compared", "mismatches", "wall s",
                              "CPU s (this process)"]))
    print(f"\n{sum(int(r[3]) for r in rows)} plans compared, columns {', '.join(COMPARED)}; tolerance: none "
          f"(equal, NaN equal to NaN); load average (1 min) {os.getloadavg()[0]:.2f}")
    if everything:
        print("\n" + mismatch_table(everything))
    print(f"\nthe {MODELS['dense'].name} search again, warm, by backend (load average (1 min) "
          f"{os.getloadavg()[0]:.2f} before)")
    print(render_table(backend_rows(), ["backend", "workers", "plans", "wall s", "CPU s (all processes)",
                                        "table equal to 1 worker's"]))
    return 1 if everything else 0


if __name__ == "__main__":
    raise SystemExit(main())

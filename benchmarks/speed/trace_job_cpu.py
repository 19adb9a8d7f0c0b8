"""CPU-seconds of cold trace jobs, shape by shape, and a check that two trees store the same entries.

    .venv/bin/python -m benchmarks.speed.trace_job_cpu --cache-dir EMPTY_DIR [--profile FILE] [--cases a,b]
    .venv/bin/python -m benchmarks.speed.trace_job_cpu --compare DIR_A DIR_B

One process runs a small warm-up job (imports, first-trace set-up), then every trace job
(capture/tracer.py ``trace_jobs`` / ``run_trace_job``) of one plan per case into an empty trace cache:
dense MT-NLG 530B at TP 8 (no recompute; full recompute with SP at micro-batch 2), a small GPT, Mixtral
8x7B (MoE, its example plan) and an MLA model. Prints the CPU-seconds (this process) per case and per
job; ``--profile`` writes cProfile stats of the timed jobs (``pstats``: sort by tottime or cumtime).
``--compare`` reads two such cache folders (say, of a base tree and an edited one) and says whether
their entries hold the same bytes per shape key, the digest of the traced code set aside.
Why: a cold search's and a cold ``vtrain size``'s time is mostly these jobs; a change to the capture
code must make them cheaper without changing a stored trace.
"""

from __future__ import annotations

import argparse
import gzip
import json
import marshal
import os
import time
from pathlib import Path


def _cases() -> dict:
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

    from benchmarks.speed.search_phases import MT_NLG_PLAN

    mt_nlg = ModelSpec(**MT_NLG_PLAN["model"])
    mixtral = ModelSpec(name="mixtral-8x7b", family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                        num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, vocab_size=32000, dtype="bf16",
                        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336)
    mla = ModelSpec(family="llama", num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=4096,
                    vocab_size=102400, dtype="bf16", ffn_hidden_size=10944, multi_latent_attention=True,
                    q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    gpt = ModelSpec(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257)
    return {
        "warm-up": (ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024,
                              dtype="bf16"), ParallelPlan(tensor_parallel=2)),
        "mtnlg-tp8": (mt_nlg, ParallelPlan(tensor_parallel=8, pipeline_parallel=35)),
        "mtnlg-tp8-full-sp": (mt_nlg, ParallelPlan(tensor_parallel=8, pipeline_parallel=35, micro_batch_size=2,
                                                   sequence_parallel=True, recompute="full")),
        "gpt-small": (gpt, ParallelPlan(pipeline_parallel=2, micro_batch_size=4, recompute="selective")),
        "mixtral": (mixtral, ParallelPlan(tensor_parallel=2, sequence_parallel=True, pipeline_parallel=4,
                                          data_parallel=8, expert_parallel=8, expert_tensor_parallel=1,
                                          moe_token_dispatcher="alltoall", recompute="selective")),
        "mla": (mla, ParallelPlan(tensor_parallel=2, pipeline_parallel=2)),
    }


def run(cache_dir: Path, profile: str | None, only: list[str] | None) -> None:
    os.environ["VTRAIN_CACHE_DIR"] = str(cache_dir)
    os.environ.pop("VTRAIN_NO_CACHE", None)
    import cProfile

    from vtrain_plugin.capture import tracer

    profiler = cProfile.Profile() if profile else None
    total = 0.0
    print(f"{'case':18} {'jobs':>4} {'CPU-s':>6} {'per job':>7}")
    for name, (model, plan) in _cases().items():
        if only and name != "warm-up" and name not in only:
            continue
        jobs = tracer.trace_jobs(model, [plan])
        timed = profiler is not None and name != "warm-up"
        start = time.process_time()
        if timed:
            profiler.enable()
        for job in jobs:
            tracer.run_trace_job(job)
        if timed:
            profiler.disable()
        spent = time.process_time() - start
        total += spent if name != "warm-up" else 0.0
        print(f"{name:18} {len(jobs):>4} {spent:>6.2f} {spent / max(1, len(jobs)):>7.3f}")
    print(f"{'all but warm-up':18} {'':>4} {total:>6.2f}")
    if profiler is not None:
        profiler.dump_stats(profile)


def entries(cache_dir: Path) -> dict[str, bytes]:
    """Each entry's stored chunk (marshal bytes) by its key, the digest of the traced code left out."""
    found = {}
    for path in (cache_dir / "traces").glob("*.marshal.gz"):
        data = marshal.loads(gzip.decompress(path.read_bytes()))
        data["key"]["versions"].pop("traced_code", None)
        found[json.dumps(data["key"], sort_keys=True)] = marshal.dumps(data["chunk"])
    return found


def compare(a: Path, b: Path) -> int:
    first, second = entries(a), entries(b)
    if first.keys() != second.keys():
        print(f"different shape keys: {len(first.keys() ^ second.keys())} in one folder only")
        return 1
    differ = sum(first[k] != second[k] for k in first)
    print(f"{len(first)} entries, {differ} differ")
    return 1 if differ or not first else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, help="an empty folder: the trace cache the jobs fill")
    parser.add_argument("--profile", help="write cProfile stats of the timed jobs here")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.cache_dir is None:
        parser.error("--cache-dir is required (or --compare)")
    if args.cache_dir.exists() and any(args.cache_dir.iterdir()):
        parser.error(f"--cache-dir {args.cache_dir} must be empty: the jobs are run cold")
    run(args.cache_dir, args.profile, args.cases.split(",") if args.cases else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Ground truth on one GPU: profile the unique kernels of GPT and Llama plans, train the same plans
for real, and write predicted against measured iteration time and peak memory.

    python -m benchmarks.device.h100_validation [--device cuda] [--plans NAME,...] [--iterations 5] [--warmup 2]
        [--db PATH] [--out benchmarks/results/h100_validation.csv] [--export benchmarks/results/h100_profiles.json]
    python -m benchmarks.device.h100_validation --smoke     # two tiny plans on the CPU: checks the script, measures nothing

For every plan (:data:`PLANS`: GPT, Llama, Qwen3 with QK-norm and an MLA model, sizes, micro-batches
and recompute modes that fit one 80 GB GPU with Adam, in bf16; ``ground_truth.sh`` runs them): the one-device plan (:func:`vtrain_plugin.measured.one_device.single_device_run`:
megatron-core's local spec, the kernels the real step runs) is traced, each of its kernels not yet
in the profile database is timed on the device (GEMMs, attention batched GEMMs, softmax, norms and
the other memory-bound kernels, the optimizer's; a single GPU runs no collectives), then the real
model trains ``warmup + iterations`` iterations (:func:`vtrain_plugin.measured.one_device.validate`) and the
median iteration after warm-up is compared with the estimate from the profiled kernels. Memory:
the estimate's tensors on the device (weights, gradients, optimizer state, activations at the peak,
without the allowance for the CUDA context and fragmentation) against ``torch.cuda.max_memory_allocated``.

Writes ``--out`` (CSV, atomically: ``plan, predicted_ms, measured_ms, error_pct, predicted_peak_gib,
measured_peak_gib, analytic_ms, analytic_error_pct, device``, where ``predicted`` is the estimate
from the profiled kernels and ``analytic`` the one from the kernel model alone; with ``--plans`` the
rows of other plans already in the file are kept) and the
profile database as a portable JSON export (``--export``; ``vtrain profile-import`` reads it). A run
that fails (out of memory, a kernel that cannot be replayed) is reported and the others go on.

On the lent GPU machine (Python 3.12 with PyTorch, pandas, PyYAML, matplotlib and tqdm, no
megatron-core; see the device tool's README), in one call: here, ``echo /.whl/ >> .git/info/exclude``
and ``python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl megatron-core==0.16.1``
(2.6 MB; it needs only torch, numpy and packaging, all there); then run with ``.whl`` carried:
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 python3 -m benchmarks.device.h100_validation --out $OUT/h100_validation.csv --export
$OUT/h100_profiles.json`` and commit the two files under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from profiler.device_timing import TimingPolicy

RESULTS = Path(__file__).resolve().parents[1] / "results"
COLUMNS = ["plan", "predicted_ms", "measured_ms", "error_pct", "predicted_peak_gib", "measured_peak_gib",
           "analytic_ms", "analytic_error_pct", "device"]


def _gpt(name: str, layers: int, hidden: int, heads: int, seq: int) -> dict[str, Any]:
    return {"name": name, "family": "gpt", "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "seq_length": seq, "vocab_size": 50257, "dtype": "bf16"}


def _llama(name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, seq: int) -> dict[str, Any]:
    return {"name": name, "family": "llama", "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_query_groups": groups, "ffn_hidden_size": ffn,
            "seq_length": seq, "vocab_size": 32000, "dtype": "bf16"}


def _plan(model: dict[str, Any], micro_batch: int, global_batch: int, recompute: str, preset: str) -> dict[str, Any]:
    return {"model": model, "parallel": {"micro_batch_size": micro_batch, "recompute": recompute},
            "training": {"global_batch_size": global_batch}, "cluster": {"preset": preset}}


GPT_350M = _gpt("gpt-350m", 24, 1024, 16, 2048)
GPT_1_3B = _gpt("gpt-1.3b", 24, 2048, 16, 2048)
LLAMA_1B = _llama("llama-1b", 16, 2048, 16, 4, 5632, 4096)

# name -> plan file mapping; each fits one 80 GB H100 with Adam's fp32 states (at most 1.3B
# parameters: 18 bytes each is 24 GB) and its activations.
PLANS: dict[str, dict[str, Any]] = {
    "gpt-350m_mb2_none": _plan(GPT_350M, 2, 8, "none", "dgx-h100"),
    "gpt-350m_mb8_full": _plan(GPT_350M, 8, 16, "full", "dgx-h100"),
    "gpt-1.3b_mb2_selective": _plan(GPT_1_3B, 2, 8, "selective", "dgx-h100"),
    "llama-1b_mb1_none": _plan(LLAMA_1B, 1, 4, "none", "dgx-h100"),
    "llama-1b_mb2_full": _plan(LLAMA_1B, 2, 8, "full", "dgx-h100"),
    "llama-1b_mb2_selective": _plan(LLAMA_1B, 2, 8, "selective", "dgx-h100"),
}

# Today's layer kinds on the local spec (TransformerEngine does not install on the lent machine):
# Qwen3 0.6B as published (QK RMSNorm, GQA 16/8, head dim 128 != hidden / heads, tied embeddings); a
# DeepSeek-V2-Lite-shaped MLA model (KV LoRA 512, no-RoPE / RoPE / value head dims 128 / 64 / 128);
# a functional-test-sized GPT (12 x 512, host-bound: what NVIDIA's CI runs measure); Llama 3.2 1B
# with selective recompute.
QWEN3_06B = {**_llama("qwen3-0.6b", 28, 1024, 16, 8, 3072, 4096), "vocab_size": 151936, "kv_channels": 128,
             "qk_layernorm": True, "tied_embeddings": True}
MLA_SMALL = {**{k: v for k, v in _llama("mla-0.5b", 12, 1024, 16, 16, 2816, 4096).items() if k != "num_query_groups"},
             "multi_latent_attention": True, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
             "v_head_dim": 128}
CI_GPT = _gpt("ci-gpt-126m", 12, 512, 8, 1024)
LLAMA32_1B = {**_llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 4096), "vocab_size": 128256, "tied_embeddings": True}
# Qwen3 1.7B as published: the device-bound end of the catalogue (1.7B parameters, 31 GB of weights,
# gradients and Adam states), which fits one H200 (141 GB) with selective recompute.
QWEN3_17B = {**_llama("qwen3-1.7b", 28, 2048, 16, 8, 6144, 4096), "vocab_size": 151936, "kv_channels": 128,
             "qk_layernorm": True, "tied_embeddings": True}
PLANS.update({
    "qwen3-0.6b_mb1_none": _plan(QWEN3_06B, 1, 4, "none", "dgx-h100"),
    "mla-0.5b_mb1_none": _plan(MLA_SMALL, 1, 4, "none", "dgx-h100"),
    "ci-gpt-126m_mb4_none": _plan(CI_GPT, 4, 32, "none", "dgx-h100"),
    "llama3.2-1b_mb1_selective": _plan(LLAMA32_1B, 1, 4, "selective", "dgx-h100"),
    "qwen3-0.6b_mb2_full": _plan(QWEN3_06B, 2, 8, "full", "dgx-h100"),
    "qwen3-1.7b_mb1_selective": _plan(QWEN3_17B, 1, 4, "selective", "dgx-h100"),
})

# Where the rows measured on each lent card are, by the device preset of that card.
GROUND_TRUTH_CSVS = {"h100-sxm": RESULTS / "h100_validation.csv", "h200-sxm": RESULTS / "h200_validation.csv"}


def on_lent_gpu(plan: str, preset: str):
    """The single-device run of ``PLANS[plan]`` on the GPU ``preset`` as the real step trains it
    (megatron-core's local spec, no FP8): what a row measured on that card is estimated as, without
    needing the card (the run is built on the CPU preset, then moved to ``preset``)."""
    from dataclasses import replace

    from vtrain_plugin.measured.one_device import single_device_run
    from vtrain_plugin.runs import run_config_from_dict, with_gpu
    from vtrain_plugin.specs.training import SoftwareStack

    single, _ = single_device_run(run_config_from_dict(PLANS[plan], source=plan), "cpu")
    local = replace(single.training, software_stack=SoftwareStack.LOCAL_SPEC, fp8=None)
    return with_gpu(replace(single, training=local), preset)


# --smoke: the same steps on the CPU with models small enough for seconds (checks the script only).
SMOKE_PLANS: dict[str, dict[str, Any]] = {
    "gpt-tiny_mb2_none": _plan({**_gpt("gpt-tiny", 2, 64, 4, 32), "vocab_size": 256, "dtype": "fp32"},
                               2, 4, "none", "local-cpu"),
    "llama-tiny_mb1_full": _plan({**_llama("llama-tiny", 2, 64, 4, 2, 256, 32), "vocab_size": 256, "dtype": "fp32"},
                                 1, 2, "full", "local-cpu"),
    "mla-tiny_mb1_none": _plan({**{k: v for k, v in _llama("mla-tiny", 2, 64, 4, 4, 128, 32).items()
                                   if k != "num_query_groups"}, "vocab_size": 256, "dtype": "fp32",
                                "multi_latent_attention": True, "kv_lora_rank": 32, "qk_head_dim": 16,
                                "qk_pos_emb_head_dim": 16, "v_head_dim": 16}, 1, 2, "none", "local-cpu"),
}


def _smoke_timing() -> TimingPolicy:
    """--smoke measures nothing: each kernel is timed once, with no cache flush between calls."""
    from profiler.device_timing import TimingPolicy

    return TimingPolicy(warmup=1, min_repetitions=1, max_repetitions=1, budget_s=0.0, flush_cpu_cache=False)


def validate_plan(name: str, mapping: dict[str, Any], device: str, db_path: Path, iterations: int,
                  warmup: int, out: Path, timing: TimingPolicy | None = None) -> dict[str, Any]:
    """Train the plan on ``device`` (compared with the analytical estimate), write that row, then
    profile its kernels there and return the row with the estimate from the profiled kernels.

    Training comes first: a kernel replay that breaks the device (an illegal address) cannot then
    lose the measurement; the row is rewritten once the profiled estimate exists.
    """
    from profiler.db import ProfileDB
    from profiler.fingerprint import current_fingerprint
    from profiler.replay import profile_kernels
    from vtrain_plugin.runs import run_config_from_dict
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.measured.one_device import validate
    from vtrain_plugin.measured.one_device import single_device_run

    run = run_config_from_dict(mapping, source=name)
    single, _ = single_device_run(run, device)
    result = validate(run, device=device, db_path=None, iterations=iterations, warmup=warmup)
    analytic = estimate(single)
    c = result.comparison
    row = {"plan": name, "predicted_ms": math.nan, "measured_ms": c.measured_ms, "error_pct": math.nan,
           "predicted_peak_gib": analytic.memory_gib[0].tensors_gib,
           "measured_peak_gib": result.peak_memory_measured_gib, "analytic_ms": analytic.iteration_time_ms,
           "analytic_error_pct": 100 * (analytic.iteration_time_ms / c.measured_ms - 1),
           "device": current_fingerprint(device).label}
    write_rows([row], out)
    _say(f"{name}: measured {c.measured_ms:,.1f} ms, analytic {analytic.iteration_time_ms:,.1f} ms, "
         f"peak {row['measured_peak_gib']:.2f} GiB; profiling")
    with ProfileDB.open(db_path) as db:
        summary = profile_kernels(trace(single.model, single.parallel).unique_kernels(), device, db, progress=False,
                                  policy=timing)
    _say(f"{name}: profiled {summary.measured} kernels ({summary.skipped} already there, "
         f"{len(summary.failed)} failed)")
    predicted = estimate(single, profile_db=db_path)
    row.update(predicted_ms=predicted.iteration_time_ms,
               error_pct=100 * (predicted.iteration_time_ms / c.measured_ms - 1))
    return row


def write_rows(rows: list[dict[str, Any]], path: Path, columns: list[str] = COLUMNS) -> None:
    """Write ``rows`` to ``path`` (atomically), keeping the rows of other plans already there."""
    import pandas as pd

    from vtrain_plugin.core.files import atomic_write_text

    frame = pd.DataFrame(rows, columns=columns)
    if path.exists():
        old = pd.read_csv(path)
        if set(old.columns) <= set(columns):  # rows of an older layout keep their values, new columns empty
            old = old.reindex(columns=columns)
            frame = pd.concat([old[~old["plan"].isin(frame["plan"])], frame], ignore_index=True)
    atomic_write_text(path, frame.to_csv(index=False, float_format="%.3f"))


def each_in_its_own_process(script: str, names: list[str], args: argparse.Namespace) -> int:
    """Run the module ``script`` (``benchmarks.device.NAME``) for every plan in a fresh interpreter sharing one profile database and one CSV.

    A trained model leaves memory behind in the process (megatron-core's global buffers, the CUDA
    caching allocator), so the next plan's fit check would see a fraction of the GPU free; and a
    training script initialises torch.distributed once per process.
    """
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or Path(tmp) / "profiles.sqlite"
        failed = 0
        for name in names:
            command = [sys.executable, "-m", script, "--plans", name, "--db", str(db_path),
                       "--out", str(args.out), "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
            command += ["--export", str(args.export)] if args.export is not None else []
            command += ["--device", args.device] if args.device else []
            command += ["--smoke"] if args.smoke else []
            try:
                failed += subprocess.run(command, check=False, timeout=args.plan_timeout).returncode != 0
            except subprocess.TimeoutExpired:  # the rows it wrote before the limit stay in the CSV
                _say(f"{name}: stopped after {args.plan_timeout:.0f} s (--plan-timeout)")
                failed += 1
    print(f"{len(names) - failed} of {len(names)} plans ran; rows in {args.out}")
    return 1 if failed else 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_run_arguments(doc: str, argv: list[str] | None, *, plans: dict[str, Any], smoke_plans: dict[str, Any],
                        out: Path, export: Path | None) -> tuple[argparse.Namespace, list[str], dict[str, Any]]:
    """The command line of a ground-truth script (this one, ``trace_in_script.py``): the arguments,
    the plan names asked for and the catalogue they are from (``smoke_plans`` with ``--smoke``)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="torch device (default: cuda; cpu with --smoke)")
    parser.add_argument("--plans", default=None, help=f"comma-separated subset of: {', '.join(plans)}")
    parser.add_argument("--iterations", type=int, default=5, help="measured iterations per plan (median)")
    parser.add_argument("--warmup", type=int, default=2, help="iterations run before measuring")
    parser.add_argument("--db", type=Path, default=None, help="profile database (default: a temporary file)")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--export", type=Path, default=export, help="portable JSON export of the profile database")
    parser.add_argument("--smoke", action="store_true", help="tiny plans on the CPU, 1 iteration")
    parser.add_argument("--plan-timeout", type=float, default=None,
                        help="seconds each plan's process may run (on a GPU, where each plan has its own)")
    args = parser.parse_args(argv)

    catalogue = smoke_plans if args.smoke else plans
    names = list(catalogue) if args.plans is None else [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        parser.error(f"--plans: unknown plan {unknown[0]!r}; known: {', '.join(catalogue)}")
    return args, names, catalogue


def main(argv: list[str] | None = None) -> int:
    args, names, catalogue = parse_run_arguments(__doc__, argv, plans=PLANS, smoke_plans=SMOKE_PLANS,
                                                 out=RESULTS / "h100_validation.csv",
                                                 export=RESULTS / "h100_profiles.json")
    device = args.device or ("cpu" if args.smoke else "cuda")
    iterations, warmup = (1, 0) if args.smoke else (args.iterations, args.warmup)
    timing = _smoke_timing() if args.smoke else None

    if device.startswith("cuda") and len(names) > 1:
        return each_in_its_own_process("benchmarks.device.h100_validation", names, args)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or Path(tmp) / "profiles.sqlite"
        for name in names:
            start = time.perf_counter()
            try:
                row = validate_plan(name, catalogue[name], device, db_path, iterations, warmup, args.out, timing)
            except Exception as exc:  # one failed plan (out of memory, say) must not lose the others
                import traceback

                traceback.print_exc()  # a benchmark's log: the whole story of a failed plan
                _say(f"{name}: FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            rows.append(row)
            _say(f"{name}: predicted {row['predicted_ms']:,.1f} ms, measured {row['measured_ms']:,.1f} ms "
                 f"({row['error_pct']:+.1f}%), peak {row['predicted_peak_gib']:.2f} / "
                 f"{row['measured_peak_gib']:.2f} GiB ({time.perf_counter() - start:.0f} s)")
            # written after every plan, so a run stopped at a time limit keeps the plans it finished
            write_rows(rows, args.out)
            from profiler.db import ProfileDB

            with ProfileDB.open(db_path) as db:
                db.export(args.export)
    if not rows:
        _say("no plan ran: nothing written")
        return 1
    from vtrain_plugin.cli.render import render_table

    table = [[r["plan"], f"{r['predicted_ms']:,.1f}", f"{r['measured_ms']:,.1f}", f"{r['error_pct']:+.1f}",
              f"{r['predicted_peak_gib']:.2f}", f"{r['measured_peak_gib']:.2f}",
              f"{100 * (r['predicted_peak_gib'] / r['measured_peak_gib'] - 1):+.1f}"
              if r["measured_peak_gib"] > 0 else "n/a"] for r in rows]
    print(render_table(table, ["plan", "predicted ms", "measured ms", "error %", "predicted GiB",
                               "measured GiB", "memory error %"]))
    errors = [abs(r["error_pct"]) for r in rows if math.isfinite(r["error_pct"])]
    print(f"{len(rows)} of {len(names)} plans on {device}; mean absolute iteration error "
          f"{sum(errors) / len(errors):.1f}%; wrote {args.out} and {args.export}")
    return 0 if len(rows) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The first use, on a real GPU: inside a training script, with its process groups up, trace the model
it built, estimate it, then train it and compare.

    python -m benchmarks.device.trace_in_script [--plans gpt-1.3b,llama-1b] [--iterations 5] [--warmup 2]
        [--out benchmarks/results/h100_trace_in_script.csv] [--export PATH]
    python -m benchmarks.device.trace_in_script --smoke     # two tiny models on the CPU (gloo): checks the script only

Each plan runs as a training script does (README, "Wrap my model, inside the training script"):
``torch.distributed`` initialised (NCCL on a GPU, gloo on the CPU; one rank), megatron-core's
parallel state and CUDA RNG tracker set up, a megatron-core ``GPTModel`` built on the device in
bf16 with the local layer spec (a GPT with learned positions and tied embeddings, or a Llama with
RMSNorm, SwiGLU, grouped-query attention, rotary positions and untied embeddings). Then, in that
process:

1. ``vtrain.trace(model, sample_input=tokens)``: the plan the script runs, read from the model;
2. the estimate from the analytical kernel model alone (what a user gets before profiling) and from
   the kernels of that graph timed on this device (``vtrain profile``'s step);
3. the process is checked as the script left it: an all-reduce on the default, tensor- and
   data-parallel groups, the model's weights unchanged;
4. the model trains ``warmup + iterations`` iterations (megatron-core forward and backward, the
   mixed-precision AdamW vtrain estimates), timed with ``vtrain.IterationRecorder``.

Writes ``--out`` (CSV, atomically; rows of other plans kept): ``plan, analytic_ms, predicted_ms,
measured_ms, analytic_error_pct, error_pct, predicted_peak_gib, measured_peak_gib, trace_s`` where
``predicted_ms`` is the profiled estimate, the peak memory is the estimate's tensors against
``torch.cuda.max_memory_allocated`` (on the CPU: the growth of the resident set), and ``trace_s`` the
wall time of ``vtrain.trace`` in the script (a child process while torch.distributed is up).

On the lent GPU machine (megatron-core carried as a wheel, see ``h100_validation.py``), each plan in
its own process: ``PYTHONPATH=/tmp/site:$PWD timeout 140 python3 -m benchmarks.device.trace_in_script
--plans llama-1b --db /tmp/p.sqlite --out $OUT/h100_trace_in_script.csv --export
$OUT/h100_trace_in_script_profiles.json``, then the same with ``--plans gpt-1.3b`` (each wrote its
row within the 140 s). On the H100 (torch 2.11, 2026-11-26) each process stayed alive after writing
its row and destroying its process group, until ``timeout`` ended it; the cause (a thread of NCCL
or megatron-core) is not yet found, hence the ``timeout``.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
COLUMNS = ["plan", "analytic_ms", "predicted_ms", "measured_ms", "analytic_error_pct", "error_pct",
           "predicted_peak_gib", "measured_peak_gib", "trace_s"]

_GPT = dict(normalization="LayerNorm", add_bias_linear=True, gated_linear_unit=False)
_LLAMA = dict(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
              hidden_dropout=0.0, attention_dropout=0.0)
_MOE = dict(qk_layernorm=True, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3)

# name -> (TransformerConfig fields, GPTModel fields, micro-batch, number of micro-batches).
# The shapes of h100_validation.py's gpt-1.3b and llama-1b, without recompute (the default a user
# starts from); each fits one 80 GB H100 with Adam's fp32 states.
PLANS: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    "gpt-1.3b": ({**_GPT, "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16},
                 {"vocab_size": 50257, "max_sequence_length": 2048, "position_embedding_type": "learned_absolute",
                  "share_embeddings_and_output_weights": True}, 2, 4),
    "llama-1b": ({**_LLAMA, "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16,
                  "num_query_groups": 4, "ffn_hidden_size": 5632},
                 {"vocab_size": 32000, "max_sequence_length": 4096, "position_embedding_type": "rope",
                  "share_embeddings_and_output_weights": False}, 1, 4),
    # Today's MoE layer as a script builds it without TransformerEngine: QK RMSNorm, GQA 16/4 with
    # head dim 128, 16 experts top-4 (megatron-core's SequentialMLP: one GEMM per expert; the grouped
    # GEMM needs TE or the grouped_gemm package), the all-to-all dispatcher, routing on real tokens.
    "moe-0.9b": ({**_LLAMA, **_MOE, "num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16,
                  "num_query_groups": 4, "kv_channels": 128, "ffn_hidden_size": 3072, "num_moe_experts": 16,
                  "moe_router_topk": 4, "moe_ffn_hidden_size": 768},
                 {"vocab_size": 32000, "max_sequence_length": 4096, "position_embedding_type": "rope",
                  "share_embeddings_and_output_weights": False}, 1, 4),
}
SMOKE_PLANS: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    "gpt-tiny": ({**_GPT, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
                 {"vocab_size": 256, "max_sequence_length": 32, "position_embedding_type": "learned_absolute",
                  "share_embeddings_and_output_weights": True}, 2, 2),
    "llama-tiny": ({**_LLAMA, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "num_query_groups": 2, "ffn_hidden_size": 176},
                   {"vocab_size": 256, "max_sequence_length": 32, "position_embedding_type": "rope",
                    "share_embeddings_and_output_weights": False}, 1, 2),
    "moe-tiny": ({**_LLAMA, **_MOE, "moe_token_dispatcher_type": "allgather", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "kv_channels": 16, "ffn_hidden_size": 176, "num_moe_experts": 4,
                  "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
                 {"vocab_size": 256, "max_sequence_length": 32, "position_embedding_type": "rope",
                  "share_embeddings_and_output_weights": False}, 1, 2),
}


def _init_process_groups(device: str, store_dir: str) -> None:
    """What a training script does first: the default group, megatron-core's parallel state, its RNG."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    if device.startswith("cuda"):
        gpu = torch.device("cuda", torch.device(device).index or 0)
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=gpu)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ps.initialize_model_parallel()
    if device.startswith("cuda"):
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:  # no CUDA generator to fork: the tracker megatron-core uses for inference forks nothing
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _build_model(config_fields: dict[str, Any], model_fields: dict[str, Any], device: str):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if config_fields.get("num_moe_experts"):
        from megatron.core.transformer.moe import moe_utils

        # megatron-core 0.16.1 without TransformerEngine never binds the name its router tests for
        # None (moe_utils.router_gating_linear): a NameError on the GPU. Bind it as the fallback means.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    fields = dict(config_fields)
    if fields.get("gated_linear_unit"):
        fields["activation_func"] = torch.nn.functional.silu
    config = TransformerConfig(**fields, bf16=on_gpu, params_dtype=dtype, pipeline_dtype=dtype,
                               use_cpu_initialization=not on_gpu, init_method_std=0.02)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, **model_fields)
    # What Megatron's Float16Module does: the torch norms of the local spec are built in fp32.
    return model.to(device=torch.device(device), dtype=dtype)


def _all_reduce_works(device: str) -> bool:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for group in (None, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
        ones = torch.ones(4, device=device)
        dist.all_reduce(ones, group=group)
        if ones.tolist() != [1.0] * 4:
            return False
    return True


def run_plan(name: str, plan: tuple[dict[str, Any], dict[str, Any], int, int], device: str, db_path: Path,
             iterations: int, warmup: int) -> dict[str, Any]:
    """Trace, estimate, check and train one plan in this process (see the module doc); its CSV row."""
    import contextlib

    import torch

    import vtrain_plugin as vtrain
    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.real_model import PeakMemory, random_micro_batch
    from megatron_adapters.training_step import MixedPrecisionAdamW, forward_backward
    from profiler.db import ProfileDB
    from profiler.replay import profile_kernels
    from vtrain_plugin.hardware.clusters import cluster_for_gpu
    from vtrain_plugin.specs.training import SoftwareStack
    from vtrain_plugin.measured.one_device import local_device_preset

    config_fields, model_fields, micro_batch, num_microbatches = plan
    on_gpu = device.startswith("cuda")
    with tempfile.TemporaryDirectory() as store_dir:
        _init_process_groups(device, store_dir)
        model = _build_model(config_fields, model_fields, device)
        seq, vocab = model_fields["max_sequence_length"], model_fields["vocab_size"]
        generator = torch.Generator(device=device).manual_seed(0)
        tokens = torch.randint(0, vocab, (micro_batch, seq), device=device, generator=generator)
        before = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

        start = time.perf_counter()
        graph = vtrain.trace(model, sample_input=tokens)
        trace_s = time.perf_counter() - start
        cluster = cluster_for_gpu(local_device_preset(device))
        training = vtrain.TrainingSpec(global_batch_size=micro_batch * num_microbatches,
                                       software_stack=SoftwareStack.LOCAL_SPEC)
        analytic = vtrain.estimate(graph, cluster=cluster, training=training, profile_db=False)
        with ProfileDB.open(db_path) as db:
            summary = profile_kernels(graph.unique_kernels(), device, db, progress=False)
        _say(f"{name}: traced in {trace_s:.1f} s; profiled {summary.measured} kernels "
             f"({summary.skipped} already there, {len(summary.failed)} failed)")
        predicted = vtrain.estimate(graph, cluster=cluster, training=training, profile_db=db_path)

        if not _all_reduce_works(device):
            raise RuntimeError("after vtrain.trace the script's process groups no longer all-reduce")
        changed = [k for k, v in model.state_dict().items() if k in before and not torch.equal(v, before[k])]
        if changed:
            raise RuntimeError(f"vtrain.trace changed the script's model: {changed[0]}")

        patches = contextlib.nullcontext() if on_gpu else cpu_tracing_patches()
        if on_gpu:  # what profiling allocated is not training's
            torch.cuda.empty_cache()
        peak = PeakMemory(torch.device(device))
        optimizer = MixedPrecisionAdamW(model.parameters())
        recorder = vtrain.IterationRecorder(warmup=warmup, synchronize=torch.cuda.synchronize if on_gpu else None)
        model.train()
        with patches:
            for _ in range(warmup + iterations):
                batches = [random_micro_batch(micro_batch, seq, vocab, torch.device(device), generator)
                           for _ in range(num_microbatches)]
                with recorder:
                    for batch in batches:
                        forward_backward(model, batch, num_microbatches=num_microbatches,
                                         loss_scale=optimizer.loss_scale)
                    optimizer.step()
        measured, analytic_vs_measured = recorder.compare(predicted), recorder.compare(analytic)
        return {"plan": name, "analytic_ms": analytic.iteration_time_ms, "predicted_ms": measured.predicted_ms,
                "measured_ms": measured.measured_ms, "analytic_error_pct": analytic_vs_measured.error_pct,
                "error_pct": measured.error_pct, "predicted_peak_gib": predicted.memory_gib[0].tensors_gib,
                "measured_peak_gib": peak.peak_bytes() / 2**30, "trace_s": trace_s}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.device.h100_validation import each_in_its_own_process, parse_run_arguments, write_rows

    args, names, catalogue = parse_run_arguments(__doc__, argv, plans=PLANS, smoke_plans=SMOKE_PLANS,
                                                 out=RESULTS / "h100_trace_in_script.csv", export=None)
    if len(names) != 1:
        return each_in_its_own_process("benchmarks.device.trace_in_script", names, args)
    device = args.device or ("cpu" if args.smoke else "cuda")
    iterations, warmup = (1, 0) if args.smoke else (args.iterations, args.warmup)
    (name,) = names
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or Path(tmp) / "profiles.sqlite"
        try:
            row = run_plan(name, catalogue[name], device, db_path, iterations, warmup)
        finally:  # a live NCCL group keeps the interpreter from exiting
            if dist.is_initialized():
                dist.destroy_process_group()
        write_rows([row], args.out, COLUMNS)
        if args.export is not None:
            from profiler.db import ProfileDB

            with ProfileDB.open(db_path) as db:
                db.export(args.export)
    _say(f"{name}: analytic {row['analytic_ms']:,.1f} ms ({row['analytic_error_pct']:+.1f}%), profiled "
         f"{row['predicted_ms']:,.1f} ms ({row['error_pct']:+.1f}%), measured {row['measured_ms']:,.1f} ms; "
         f"peak {row['predicted_peak_gib']:.2f} / {row['measured_peak_gib']:.2f} GiB")
    return 0 if math.isfinite(row["error_pct"]) else 1


if __name__ == "__main__":
    sys.exit(main())

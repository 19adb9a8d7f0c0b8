"""The host time megatron-core's DDP hooks add, measured on this CPU: the forward pre-hook that
``overlap_param_gather`` puts on every module, and the gradient hook's ``register_grad_ready`` that
``overlap_grad_reduce`` adds per parameter; and the distributed optimizer's per-parameter copies.

    python -m benchmarks.accuracy.ddp_host_time [--repeats 15]

A megatron-core local-spec GPT (12 layers, hidden 64, 64 tokens, fp32 on the CPU; built as
``benchmarks/accuracy/moe_host_time.py`` builds its models, on gloo, one rank) is wrapped in
megatron-core's own ``DistributedDataParallel`` with the distributed optimizer. The forward is
timed with the pre-hooks enabled and disabled, interleaved (CPU seconds, median); the hook calls are
counted, so their difference per call is what one hook costs the host (the hook's Python, and
``nn.Module.__call__`` taking its slow path). The backward is timed on two such models, with and
without ``overlap_grad_reduce``, inside ``no_sync`` (every micro-batch but the last), per parameter.
The optimizer step's two loops over the parameters (gradients into the main parameters' ``.grad``,
main weights into the model's) are timed per parameter as ``DistributedOptimizer`` and
``Float16OptimizerWithFloat16Params`` run them (their own methods, on optimizers holding just the
state those methods read: megatron-core builds neither without CUDA).
Why: vtrain prices these hooks (:mod:`vtrain_plugin.cost.ddp_hooks`) at the cost measured here;
results: benchmarks/results/2026-12-04_ddp_host_costs.txt.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.device.trace_in_script import _build_model, _init_process_groups

GPT = dict(num_layers=12, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, add_bias_linear=True)
GPT_FIELDS = {"vocab_size": 256, "max_sequence_length": 64, "position_embedding_type": "learned_absolute",
              "share_embeddings_and_output_weights": True}
PASSES = 5  # forward or backward passes per timed sample


def _wrapped(overlap_grad_reduce: bool):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_adapters.cpu_patches import cpu_tracing_patches

    with cpu_tracing_patches():
        model = _build_model(GPT, GPT_FIELDS, "cpu")
        config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               overlap_param_gather=overlap_grad_reduce)
        ddp = DistributedDataParallel(config=model.config, ddp_config=config, module=model)
    for group in ddp.bucket_groups:  # gathered already: each hook call is the steady state's
        group.param_gather_dispatched = True
    del torch
    return model, ddp


def _seconds(run) -> float:
    start = time.process_time()
    for _ in range(PASSES):
        run()
    return (time.process_time() - start) / PASSES


def _optimizer_loops(model, ddp) -> dict[str, tuple]:
    """Each optimizer's (copy gradients, copy weights) methods over ``model``'s parameters."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    params = [p for buffer in ddp.buffers for p in buffer.params]
    config = OptimizerConfig(bf16=True, use_distributed_optimizer=True)
    dist = object.__new__(DistributedOptimizer)
    dist.is_stub_optimizer, dist.config, dist.ddp_config, dist.buffers = False, config, ddp.ddp_config, ddp.buffers
    dist.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(buffer) for buffer in ddp.buffers]
    dist.model_param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(dist.gbuf_ranges)
    dist.data_parallel_group = ps.get_data_parallel_group()
    dist.model_float16_groups, dist.model_fp32_groups, dist.shard_fp32_groups = [params], [[]], [[]]
    dist.shard_fp32_from_float16_groups = [[p.detach().clone().view(-1) for p in params]]
    plain = object.__new__(Float16OptimizerWithFloat16Params)
    plain.is_stub_optimizer, plain.config, plain._dummy_overflow_buf = False, config, None  # bf16: no multi-tensor copy
    plain.float16_groups, plain.fp32_from_fp32_groups = [params], [[]]
    plain.fp32_from_float16_groups = [[p.detach().clone() for p in params]]
    return {"distributed": (dist._copy_model_grads_to_main_grads, dist._copy_main_params_to_model_params),
            "float16": (plain._copy_model_grads_to_main_grads, plain._copy_main_params_to_model_params)}


def measure(repeats: int) -> dict[str, float]:
    import torch

    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.real_model import random_micro_batch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as store_dir:
        _init_process_groups("cpu", store_dir)
        batch = random_micro_batch(1, GPT_FIELDS["max_sequence_length"], GPT_FIELDS["vocab_size"],
                                   torch.device("cpu"), torch.Generator().manual_seed(0))
        model, ddp = _wrapped(overlap_grad_reduce=True)
        plain_model, plain = _wrapped(overlap_grad_reduce=False)
        calls = [0]

        def count(*_):
            calls[0] += 1

        def forward(wrapper):
            with torch.no_grad(), cpu_tracing_patches():
                return wrapper(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)

        handles = [m.register_forward_pre_hook(count) for m in model.modules()]
        forward(ddp)
        for h in handles:
            h.remove()

        def step(wrapper):
            with cpu_tracing_patches(), wrapper.no_sync():
                loss = wrapper(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels).sum()
                start = time.process_time()
                loss.backward()
                return time.process_time() - start

        on, off, grad_overlap, grad_plain = [], [], [], []
        loops = _optimizer_loops(plain_model, plain)
        copies = {(name, part): [] for name in loops for part in ("grads", "weights")}
        for _ in range(2):
            forward(ddp), step(ddp), step(plain)
            for methods in loops.values():
                methods[0](), methods[1]()
        for _ in range(repeats):
            on.append(_seconds(lambda: forward(ddp)))
            ddp.disable_forward_pre_hook(param_sync=False)
            off.append(_seconds(lambda: forward(ddp)))
            ddp.enable_forward_pre_hook()
            for group in ddp.bucket_groups:
                group.param_gather_dispatched = True
            grad_overlap.append(statistics.fmean(step(ddp) for _ in range(PASSES)))
            grad_plain.append(statistics.fmean(step(plain) for _ in range(PASSES)))
            for name, methods in loops.items():
                for part, method in zip(("grads", "weights"), methods):
                    copies[name, part].append(_seconds(method))
        params = sum(1 for p in model.parameters() if p.requires_grad)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
        del plain_model
    median = statistics.median
    return {"hook_calls": calls[0], "params": params, "forward_on_ms": 1e3 * median(on),
            "forward_off_ms": 1e3 * median(off),
            "pre_hook_us": 1e6 * median(a - b for a, b in zip(on, off)) / calls[0],
            "backward_overlap_ms": 1e3 * median(grad_overlap), "backward_plain_ms": 1e3 * median(grad_plain),
            "grad_ready_us": 1e6 * median(a - b for a, b in zip(grad_overlap, grad_plain)) / params,
            **{f"{name} {part} us": 1e6 * median(t) / params for (name, part), t in copies.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} must be at least 1")
    result = measure(args.repeats)
    print(f"forward: {result['hook_calls']} module calls, {result['forward_on_ms']:.2f} ms with the pre-hooks, "
          f"{result['forward_off_ms']:.2f} ms without: {result['pre_hook_us']:.2f} us per hook call")
    print(f"backward (no_sync): {result['params']} parameters, {result['backward_overlap_ms']:.2f} ms with "
          f"overlap_grad_reduce, {result['backward_plain_ms']:.2f} ms without: {result['grad_ready_us']:.2f} us "
          f"per parameter")
    for part in ("grads", "weights"):
        dist, plain = result[f"distributed {part} us"], result[f"float16 {part} us"]
        print(f"optimizer step, {part} copied: {dist:.2f} us per parameter (DistributedOptimizer), {plain:.2f} us "
              f"(Float16OptimizerWithFloat16Params, bf16): {dist - plain:+.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

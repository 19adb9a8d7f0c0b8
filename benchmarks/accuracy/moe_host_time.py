"""Where an eager megatron-core step's host time goes, MoE against dense: measured on this CPU.

    python -m benchmarks.accuracy.moe_host_time [--plans moe-host,dense-host] [--repeats 5]

With tiny tensors a CPU step is all host. Each plan (megatron-core's local-spec GPTModel on gloo,
one rank, as ``benchmarks/device/trace_in_script.py`` builds it; vtrain's MixedPrecisionAdamW) is
timed per phase (forward with the loss, backward, optimizer step; CPU seconds, median of
``--repeats``) and counted: the ATen ops each phase dispatches (a TorchDispatchMode), the autograd
nodes backward evaluates, the module calls forward makes, and the forward ops by part of the layer
(router, the MoE layer's own dispatch code, experts, attention, rest). Then the same model traced by
``vtrain.trace``: its kernels per phase, module calls and layer calls, which is what the cost model
charges (``host_overhead_ns`` per kernel, ``module_host_overhead_ns`` per module call,
``layer_host_overhead_ns`` per layer). The plans share moe-0.9b's structure (12 layers, GQA with QK
norm, 16 experts top-4, SequentialMLP, all-to-all dispatcher), at hidden size 64 and 64 tokens.
Results: benchmarks/results/2026-12-03_moe_host_time.txt.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import tempfile
import time
from typing import Any

from benchmarks.device.trace_in_script import _LLAMA, _MOE
from benchmarks.device.trace_in_script import PLANS as SCRIPT_PLANS
from benchmarks.device.trace_in_script import _build_model, _init_process_groups

_SHAPE = dict(num_layers=12, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
              qk_layernorm=True)
_GPT_FIELDS = {"vocab_size": 256, "max_sequence_length": 64, "position_embedding_type": "rope",
               "share_embeddings_and_output_weights": False}
PLANS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "moe-host": ({**_LLAMA, **_MOE, **_SHAPE, "ffn_hidden_size": 192, "num_moe_experts": 16, "moe_router_topk": 4,
                  "moe_ffn_hidden_size": 48}, _GPT_FIELDS),
    "moe-host-allgather": ({**_LLAMA, **_MOE, **_SHAPE, "moe_token_dispatcher_type": "allgather", "ffn_hidden_size": 192,
                            "num_moe_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 48}, _GPT_FIELDS),
    "dense-host": ({**_LLAMA, **_SHAPE, "ffn_hidden_size": 192}, _GPT_FIELDS),
    # For a GPU (--device cuda): trace_in_script.py's moe-0.9b as measured on the H200, and the same
    # model with a dense MLP, the reference its host costs are scaled by.
    "moe-0.9b": SCRIPT_PLANS["moe-0.9b"][:2],
    "dense-0.9b": ({k: v for k, v in SCRIPT_PLANS["moe-0.9b"][0].items() if k not in _MOE and not k.startswith("moe_")
                    and k != "num_moe_experts"} | {"qk_layernorm": True}, SCRIPT_PLANS["moe-0.9b"][1]),
}


# ATen ops whose output size or value the host reads on a GPU: each makes the host wait for the device.
SYNCING_OPS = frozenset({"_local_scalar_dense", "masked_select", "nonzero", "unique", "_unique2", "repeat_interleave",
                         "bincount"})


class _HostStream:
    """A CUDA stream's and event's host side as the all-to-all dispatcher calls it, for the CPU:
    its device-to-host copies of the splits run in place (a CPU step has no queue to drain)."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_HostStream":
        return self

    def synchronize(self) -> None:
        pass


def _stream_patches() -> list[tuple[Any, str, Any]]:
    import torch
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    side, current = _HostStream(), _HostStream()
    return [(torch.cuda, "current_stream", lambda *a, **k: current),
            (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
            (MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", side)]


def part_of(module: str) -> str:
    """The part of a layer a forward op issued inside ``module`` (innermost) belongs to."""
    if ".mlp.router" in module:
        return "router"
    if ".mlp.experts" in module:
        return "experts"
    if ".mlp" in module and ".layers." in module:
        return "mlp / MoE dispatch"
    if ".self_attention" in module:
        return "attention"
    return "rest"


class _Counter:
    """ATen ops dispatched (by phase, and in forward by part), with the innermost module called."""

    def __init__(self, model) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.ops: collections.Counter = collections.Counter()
        self.parts: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.module_calls = 0
        self.phase = ""
        stack: list[str] = []
        names = {id(m): n for n, m in model.named_modules()}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops[counter.phase] += 1
                if func.overloadpacket.__name__ in SYNCING_OPS:
                    counter.syncs[(counter.phase, func.overloadpacket.__name__)] += 1
                if counter.phase == "forward":
                    counter.parts[part_of(stack[-1] if stack else "")] += 1
                return func(*args, **(kwargs or {}))

        def pre(module, _args):
            stack.append(names.get(id(module), ""))
            if counter.phase == "forward":
                counter.module_calls += 1

        def post(module, _args, _out):
            stack.pop()

        self.mode = Mode()
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                       torch.nn.modules.module.register_module_forward_hook(post)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _phases(model, optimizer, batch, counter: _Counter | None = None, sync=None) -> dict[str, float]:
    """One step, each phase's CPU seconds (process time) and, as ``"<phase> wall"``, wall seconds;
    on a GPU ``sync`` drains the queue at each phase's end (its wait counts in the phase)."""
    import torch

    from megatron_adapters.training_step import micro_batch_loss

    out: dict[str, float] = {}
    marks: list[tuple[float, float]] = []
    mode = counter.mode if counter is not None else contextlib.nullcontext()

    def mark(name: str) -> None:
        if sync is not None:
            sync()
        if counter is not None:
            counter.phase = name
        marks.append((time.process_time(), time.perf_counter()))
        if len(marks) > 1:
            (c0, w0), (c1, w1) = marks[-2:]
            done = ("forward", "backward", "optimizer")[len(marks) - 2]
            out[done], out[f"{done} wall"] = c1 - c0, w1 - w0

    with mode:
        mark("forward")
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        _, scaled = micro_batch_loss(output, batch.loss_mask, num_microbatches=1, loss_scale=optimizer.loss_scale)
        mark("backward")
        torch.autograd.backward(scaled)
        mark("optimizer")
        optimizer.step()
        mark("")
    return out


def _part_times(model, optimizer, batch, repeats: int, sync=None) -> dict[str, float]:
    """Forward CPU ms by part (median of ``repeats`` steps): the attention, router, experts and MoE
    layer modules timed inclusive by hooks; the dispatch is the MoE layer less router and experts."""
    spent: dict[str, list[float]] = collections.defaultdict(list)
    total: dict[str, float] = collections.defaultdict(float)
    hooks = []
    for name, module in model.named_modules():
        key = next((k for k in ("self_attention", "mlp.router", "mlp.experts", "mlp") if name.endswith("." + k)), None)
        if key is None or ".layers." not in name:
            continue
        started: list[float] = []
        hooks.append(module.register_forward_pre_hook(lambda m, a, s=started: s.append(time.process_time())))
        hooks.append(module.register_forward_hook(
            lambda m, a, o, s=started, k=key: total.__setitem__(k, total[k] + time.process_time() - s.pop())))
    try:
        for _ in range(repeats):
            total.clear()
            step = _phases(model, optimizer, batch, sync=sync)
            for k, v in total.items():
                spent[k].append(v)
            spent["forward"].append(step["forward"])
    finally:
        for h in hooks:
            h.remove()
    ms = {k: 1e3 * statistics.median(v) for k, v in spent.items()}
    mlp = ms.get("mlp", 0.0)
    out = {"attention": ms.get("self_attention", 0.0), "router": ms.get("mlp.router", 0.0),
           "experts": ms.get("mlp.experts", 0.0)}
    out["mlp / MoE dispatch"] = mlp - out["router"] - out["experts"]
    out["rest"] = ms["forward"] - ms.get("self_attention", 0.0) - mlp
    return out


def _autograd_nodes(model, batch, optimizer) -> int:
    """Nodes of the backward graph of one micro-batch's loss (each one the engine evaluates)."""
    from megatron_adapters.training_step import micro_batch_loss

    output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    _, scaled = micro_batch_loss(output, batch.loss_mask, num_microbatches=1, loss_scale=optimizer.loss_scale)
    seen, todo = set(), [scaled.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    for p in model.parameters():
        p.grad = None
    return len(seen)


def trace_counts(graph) -> dict[str, float]:
    """What the cost model charges host time for, per micro-batch and optimizer step: kernels by
    phase, module calls and layer calls (cost/prepare.py host_calls, counted from the blocks)."""
    from vtrain_plugin.core.graph import BlockKind, OpNode, Phase
    from vtrain_plugin.cost.kernels.model import KernelBatch, KernelKind

    counts: dict[str, float] = collections.defaultdict(float)
    for stage in graph.stages:
        for block in stage.blocks:
            ops = [n for n in block.nodes if isinstance(n, OpNode)]
            kinds = KernelBatch.of(ops).kind if ops else []
            modules: dict[Phase, set[str]] = collections.defaultdict(set)
            for op, kind in zip(ops, kinds):
                if kind == KernelKind.NONE:
                    continue
                counts[op.phase.value] += block.count
                counts[f"{op.phase.value}: {part_of(op.module)}"] += block.count
                if op.phase is not Phase.OPTIMIZER:
                    modules[op.phase].add(op.module)
            for phase, names in modules.items():
                counts[f"{phase.value} module calls"] += block.count * len(names)
                for module in names:
                    counts[f"{phase.value} module calls: {part_of(module)}"] += block.count
            if block.kind is BlockKind.LAYER:
                counts["layer calls"] += block.count * len(modules)
    return dict(counts)


def _allocator_counts(torch) -> dict[str, int]:
    """The CUDA caching allocator's device allocations and frees (cudaMalloc / cudaFree: the free
    synchronizes the device) and its retries after a failed allocation, so far."""
    stats = torch.cuda.memory_stats()
    return {"segments allocated": stats.get("segment.all.allocated", 0),
            "segments freed": stats.get("segment.all.freed", 0), "retries": stats.get("num_alloc_retries", 0)}


def measure(name: str, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Time, count and trace plan ``name`` on ``device`` (see the module doc)."""
    import torch

    import vtrain_plugin as vtrain
    from megatron_adapters.cpu_patches import cpu_tracing_patches, patched
    from megatron_adapters.real_model import random_micro_batch
    from megatron_adapters.training_step import MixedPrecisionAdamW

    on_gpu = device.startswith("cuda")
    if not on_gpu:
        torch.set_num_threads(1)
    # On the CPU the CUDA entry points megatron-core calls, and the dispatcher's streams, are stood in for.
    patches = contextlib.ExitStack
    sync = torch.cuda.synchronize if on_gpu else None
    config_fields, model_fields = PLANS[name]
    with tempfile.TemporaryDirectory() as store_dir:
        _init_process_groups(device, store_dir)
        with patches() as stack:
            if not on_gpu:
                stack.enter_context(cpu_tracing_patches())  # the all-to-all dispatcher makes a stream when built
            model = _build_model(config_fields, model_fields, device)
        seq, vocab = model_fields["max_sequence_length"], model_fields["vocab_size"]
        generator = torch.Generator(device=device).manual_seed(0)
        tokens = torch.randint(0, vocab, (1, seq), device=device, generator=generator)
        with patches() as stack:
            if not on_gpu:
                stack.enter_context(patched(_stream_patches()))
            graph = vtrain.trace(model, sample_input=tokens)
        traced = trace_counts(graph)
        optimizer = MixedPrecisionAdamW(model.parameters())
        batch = random_micro_batch(1, seq, vocab, torch.device(device), generator)
        model.train()
        with patches() as stack:
            if not on_gpu:
                stack.enter_context(cpu_tracing_patches())
                stack.enter_context(patched(_stream_patches()))
            for _ in range(2):
                _phases(model, optimizer, batch, sync=sync)
            before = _allocator_counts(torch) if on_gpu else {}
            times = [_phases(model, optimizer, batch, sync=sync) for _ in range(repeats)]
            allocator = {k: v - before[k] for k, v in _allocator_counts(torch).items()} if on_gpu else {}
            counter = _Counter(model)
            try:
                _phases(model, optimizer, batch, counter, sync=sync)
            finally:
                counter.close()
            nodes = _autograd_nodes(model, batch, optimizer)
            parts_ms = _part_times(model, optimizer, batch, repeats, sync)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
    median = {p: statistics.median(t[p] for t in times) for p in times[0]}
    return {"plan": name, "device": device, "cpu_s": {p: median[p] for p in ("forward", "backward", "optimizer")},
            "wall_s": {p: median[f"{p} wall"] for p in ("forward", "backward", "optimizer")},
            "ops": dict(counter.ops), "parts": dict(counter.parts), "module_calls": counter.module_calls,
            "parts_ms": parts_ms, "syncs": {f"{phase} {op}": n for (phase, op), n in sorted(counter.syncs.items())},
            "autograd_nodes": nodes, "parameters": sum(1 for _ in model.parameters()), "traced": traced,
            "allocator": allocator}


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['plan']} ({result['device']}): {result['parameters']} parameters; CPU ms (median), "
             "wall ms / ATen ops / CPU us per op"]
    for p in ("forward", "backward", "optimizer"):
        ms, n = 1e3 * result["cpu_s"][p], result["ops"].get(p, 0)
        lines.append(f"  {p:<10} {ms:9.2f} ms {1e3 * result['wall_s'][p]:9.2f} ms  {n:6d} ops  "
                     f"{1e3 * ms / max(n, 1):6.1f} us/op   "
                     f"traced kernels {result['traced'].get(p, 0):6.0f}")
    lines.append(f"  forward module calls (hooks) {result['module_calls']}; autograd nodes {result['autograd_nodes']}")
    if result["allocator"]:
        lines.append("  during the timed steps, the caching allocator's " + ", ".join(
            f"{k} {v}" for k, v in result["allocator"].items()))
    lines.append("  ops the host would wait on, on a GPU: "
                 + (", ".join(f"{k} {v}" for k, v in result["syncs"].items()) or "none"))
    lines.append(f"  {'forward by part':<20} {'CPU ms':>8} {'ATen ops':>9} {'traced kernels':>15} "
                 f"{'traced module calls':>20} {'us/traced kernel':>17}")
    traced = result["traced"]
    for part, ms in sorted(result["parts_ms"].items()):
        k = traced.get(f"forward: {part}", 0)
        lines.append(f"  {part:<20} {ms:8.2f} {result['parts'].get(part, 0):9d} {k:15.0f} "
                     f"{traced.get(f'forward module calls: {part}', 0):20.0f} {1e3 * ms / max(k, 1):17.1f}")
    lines.append("  traced: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(traced.items()) if "calls" in k))
    return "\n".join(lines)


def charged_ms(traced: dict[str, float], constants) -> dict[str, float]:
    """Host ms the cost model charges one micro-batch's forward and backward and the optimizer step
    for, at ``constants`` (``host_time_factor`` aside): kernels, module calls, layer calls."""
    c = constants
    out = {}
    for phase, per_kernel in (("forward", c.host_overhead_ns), ("backward", c.backward_host_overhead_ns)):
        out[phase] = 1e-6 * (traced.get(phase, 0) * per_kernel + traced.get(f"{phase} module calls", 0)
                             * c.module_host_overhead_ns + traced.get("layer calls", 0) / 2 * c.layer_host_overhead_ns)
    out["optimizer"] = 1e-6 * traced.get("optimizer", 0) * c.host_overhead_ns
    return out


def scaled_rows(results: list[dict[str, Any]], reference: dict[str, Any], constants) -> list[str]:
    """Each plan's phases against the model's charge scaled, phase by phase, by this CPU's measured
    time over the charge of ``reference`` (the dense plan): the CPU host against the one the
    constants were fitted on, by the dense ops measured on both."""
    ref = charged_ms(reference["traced"], constants)
    scale = {p: 1e3 * reference["cpu_s"][p] / ref[p] for p in ref}
    lines = ["scale (this CPU's ms per ms charged, from " + reference["plan"] + "): "
             + ", ".join(f"{p} {v:.3f}" for p, v in scale.items())]
    for r in results:
        charged = charged_ms(r["traced"], constants)
        parts = []
        for p in ("forward", "backward", "optimizer"):
            m, e = 1e3 * r["cpu_s"][p], charged[p] * scale[p]
            parts.append(f"{p} {m:.2f} / {e:.2f} ms ({100 * (e / m - 1):+.0f}%)")
        m, e = 1e3 * sum(r["cpu_s"].values()), sum(charged[p] * scale[p] for p in scale)
        lines.append(f"  {r['plan']}: measured / charged x scale: " + "; ".join(parts)
                     + f"; step {m:.2f} / {e:.2f} ms ({100 * (e / m - 1):+.1f}%)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", default="moe-host,moe-host-allgather,dense-host")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (--plans moe-0.9b,dense-0.9b)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--constants", default="h200-sxm", help="device whose 'default' calibration file charges")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        parser.error(f"--plans: unknown plan {unknown[0]!r}; one of {', '.join(PLANS)}")
    if args.repeats < 1:
        parser.error("--repeats: must be at least 1")
    results = []
    for name in names:
        results.append(measure(name, args.repeats, args.device))
        print(report(results[-1]), flush=True)
    reference = next((r for r in results if r["plan"].startswith("dense")), None)
    if reference is not None:
        from vtrain_plugin.hardware.calibration import calibration_for

        print("\n".join(scaled_rows(results, reference, calibration_for(args.constants, "default").constants)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

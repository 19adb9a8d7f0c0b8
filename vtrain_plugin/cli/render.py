"""Human and machine renderings of the CLI's results: traced graphs, estimates, validations.

A traced graph is shown with Megatron's runtime collectives (DP gradients, pipeline transfers, tied
embeddings) that costing derives from it, marked ``synthesized``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vtrain_plugin.core.graph import Block, OpGraph, OpNode, Phase, StageGraph
from vtrain_plugin.cost.runtime_collectives import runtime_collectives
from vtrain_plugin.estimate import Estimate
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.validate import ValidationResult


def _fmt_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def render_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def trace_table(graph: OpGraph) -> str:
    header = ["stage", "layers", "fwd/layer", "bwd/layer", "recomp/layer", "unique kernels",
              "TFLOP/micro-batch/rank", "collectives per layer"]
    rows = []
    for s in graph.stages:
        layer = s.layer_template()
        counts = Counter(op.phase for op in layer.ops()) if layer else Counter()
        per_stage = {op.key for b in s.blocks for op in b.ops()}
        rows.append([
            _stage_name(s, graph), str(s.num_layers), str(counts[Phase.FORWARD]), str(counts[Phase.BACKWARD]),
            str(counts[Phase.RECOMPUTE]), str(len(per_stage)), f"{s.flops() / 1e12:.2f}",
            _collective_summary(layer) if layer else "-",
        ])
    model, plan = graph.model, graph.parallel
    dims = f"layers={model.num_layers} hidden={model.hidden_size}" if model is not None else "layers=? hidden=?"
    title = (f"model: {graph.name} {dims}  "
             f"parallel: tp={plan.tensor_parallel} pp={plan.pipeline_parallel} "
             f"dp={plan.data_parallel} sp={plan.sequence_parallel} "
             f"vp={plan.virtual_pipeline} recompute={plan.recompute.value}  "
             f"micro-batch={graph.micro_batch_size} seq={graph.seq_length}")
    total = graph.flops() * plan.tensor_parallel
    footer = (f"unique kernels: {len(graph.unique_kernels())}   model FLOPs per micro-batch "
              f"(all TP ranks): {total / 1e12:.1f} TFLOP")
    return "\n".join([title, "", render_table(rows, header), "", footer])


def _stage_name(s: StageGraph, graph: OpGraph) -> str:
    return f"{s.pipeline_rank}" if graph.parallel.virtual_pipeline == 1 else f"{s.pipeline_rank}.{s.chunk}"


def _collective_summary(layer: Block) -> str:
    groups: Counter[tuple[str, str, str, int]] = Counter()
    for c in layer.collectives():
        groups[(c.phase.value[:3], c.kind.value, c.group.value, c.nbytes)] += 1
    return ", ".join(f"{n}x {kind} {group} {_fmt_bytes(nb)} ({phase})"
                     for (phase, kind, group, nb), n in groups.items()) or "-"


def trace_json(graph: OpGraph) -> dict[str, Any]:
    """Per stage: ``ops`` and ``collectives``, identical entries merged with a ``count``."""
    stages = []
    tied = graph.model is not None and graph.model.tied
    for s in graph.stages:
        ops: dict[tuple, dict[str, Any]] = {}
        collectives: dict[tuple, dict[str, Any]] = {}
        runtime = runtime_collectives(s, graph.parallel, dtype=graph.dtype, tied_embeddings=tied).nodes(s)
        blocks = [(b.kind.value, b.count, b.nodes) for b in s.blocks] + [("runtime", 1, runtime)]
        for block_kind, count, nodes in blocks:
            for n in nodes:
                if isinstance(n, OpNode):
                    k = (n.key, n.phase, n.module)
                    entry = ops.setdefault(k, {
                        "op": n.op, "input_shapes": [list(x) for x in n.key.input_shapes],
                        "dtypes": list(n.key.dtypes), "args": n.key.to_dict()["args"],
                        "phase": n.phase.value, "module": n.module, "block": block_kind,
                        "launches_kernel": n.launches_kernel, "flops": n.flops, "nbytes": n.nbytes,
                        "kernel": n.key.digest, "count": 0})
                else:
                    k = (n.kind, n.nbytes, n.group, n.group_size, n.phase, n.module)
                    entry = collectives.setdefault(k, {
                        "kind": n.kind.value, "nbytes": n.nbytes, "group": n.group.value,
                        "group_size": n.group_size, "phase": n.phase.value, "module": n.module,
                        "block": block_kind, "dtype": n.dtype, "synthesized": n.synthesized, "count": 0})
                entry["count"] += count
        stages.append({"pipeline_rank": s.pipeline_rank, "chunk": s.chunk, "num_layers": s.num_layers,
                       "num_parameters": s.num_parameters, "flops": s.flops(),
                       "ops": list(ops.values()), "collectives": list(collectives.values())})
    return {"schema_version": graph.schema_version,
            "model": None if graph.model is None else graph.model.to_dict(), "parallel": graph.parallel.to_dict(),
            "micro_batch_size": graph.micro_batch_size, "seq_length": graph.seq_length,
            "stages": stages}


def estimate_table(run: RunConfig, result: Estimate) -> str:
    """The breakdown table of ``vtrain estimate``."""
    plan = run.parallel
    lines = [
        f"{run.source}: {run.model.name or run.model.family.value} {run.model.num_layers} layers, hidden "
        f"{run.model.hidden_size} on {result.num_gpus} x {result.gpu} "
        f"(tp={plan.tensor_parallel} pp={plan.pipeline_parallel} dp={plan.data_parallel} "
        f"micro-batch={plan.micro_batch_size} global batch={result.global_batch_size} "
        f"micro-batches={result.num_microbatches}, {run.training.schedule.value}, recompute={plan.recompute.value})",
        "",
    ]
    total = result.iteration_time_ms
    rows = [[name, f"{ms:,.1f}", f"{100 * ms / total:.1f}%"] for name, ms in result.breakdown_ms.items()]
    rows.append(["iteration", f"{total:,.1f}", "100.0%"])
    lines.append(render_table(rows, ["breakdown (bottleneck stage)", "ms", "share"]))
    lines.append("")
    cost = "n/a" if result.cost_usd is None else f"${result.cost_usd:,.2f} per iteration"
    lines.append(f"tokens/s {result.tokens_per_second:,.0f}   model TFLOP/s per GPU {result.tflops_per_gpu:.1f}   "
                 f"MFU {100 * result.mfu:.1f}%   cost {cost}")
    if result.iterations is not None:
        train_cost = "" if result.train_cost_usd is None else f", ${result.train_cost_usd:,.0f}"
        lines.append(f"to train {result.total_tokens:,.0f} tokens: {result.iterations:,} iterations, "
                     f"{result.train_days:,.1f} days, {result.train_gpu_hours:,.0f} GPU-hours{train_cost}")
    lines.append(f"kernel time measured: {100 * result.measured_fraction:.1f}% (rest modeled)")
    peak = max(result.memory_gib, key=lambda m: m.total_gib)
    verdict = "fits" if result.fits_in_memory else "DOES NOT FIT"
    lines.append(f"memory per GPU (peak stage): {peak.total_gib:.1f} GiB of {result.gpu_memory_gib:.0f} GiB, "
                 f"{verdict} (weights {peak.weights_gib:.1f}, gradients {peak.gradients_gib:.1f}, "
                 f"optimizer {peak.optimizer_gib:.1f}, activations {peak.activations_gib:.1f} for "
                 f"{peak.inflight_microbatches} micro-batches in flight)")
    if result.largest_unmeasured:
        lines.append("")
        rows = [[k.op, " x ".join(str(list(s)) for s in k.input_shapes), k.phase, k.module, f"{k.time_ms:,.1f}"]
                for k in result.largest_unmeasured]
        lines.append(render_table(rows, ["largest unmeasured kernels", "shapes", "phase", "module", "ms/iter"]))
    return "\n".join(lines)


def validation_table(result: ValidationResult) -> str:
    """The human rendering of ``vtrain validate``."""
    c = result.comparison
    lines = [f"{result.config} on {result.device}: {result.num_microbatches} micro-batches per iteration, "
             f"median of {len(c.measured_iterations_ms)} iterations after {result.warmup_iterations} warm-up"]
    if result.overridden:
        lines.append(f"one device: {', '.join(result.overridden)}")
    lines.append("")
    lines.append(render_table([[f"{c.predicted_ms:,.1f}", f"{c.measured_ms:,.1f}", f"{c.error_pct:+.1f}%"]],
                              ["predicted ms", "measured ms", "error"]))
    lines.append("")
    lines.append(f"peak memory measured: {result.peak_memory_measured_gib:.2f} GiB   "
                 f"kernel time measured in the prediction: {100 * result.measured_fraction:.1f}%")
    if result.measured_fraction < 1.0:
        lines.append("(kernels missing from the profile database were modeled; run `vtrain profile` on this "
                     "device first)")
    return "\n".join(lines)

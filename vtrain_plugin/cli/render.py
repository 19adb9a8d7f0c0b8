"""Human and machine renderings of the CLI's results: traced graphs, estimates, validations, searches.

A traced graph is shown with what costing derives from it: Megatron's runtime collectives (DP
gradients, pipeline transfers, tied embeddings) and, under context parallelism, each layer's CP
attention (:mod:`vtrain_plugin.cost.comm.context_parallel`) in its stack kernels and collectives, the
derived collectives marked ``synthesized``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.capture.folding import layer_kind, mtp_layer
from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, OpNode, Phase, StageGraph
from vtrain_plugin.core.units import GBYTE, MEGABYTE, SECONDS_PER_HOUR, SECONDS_PER_MINUTE
from vtrain_plugin.cost.comm.context_parallel import ContextParallel, model_flops, with_context_parallel
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.estimate import Estimate
from vtrain_plugin.sim.run_totals import TrainTotals
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import Fp8Settings, SoftwareStack

if TYPE_CHECKING:  # the measured and planning layers are imported by the commands that use them, not by every render
    import pandas as pd

    from vtrain_plugin.measured.one_device import ValidationResult
    from vtrain_plugin.planning.search import SearchResult
    from vtrain_plugin.planning.sizing import SizingResult


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


def trace_table(graph: OpGraph, stack: SoftwareStack, fp8: Fp8Settings | None = None, *,
                unfused_attention: bool = False, unfused: tuple[str, ...] = ()) -> str:
    """Per stage and layer kind (:func:`layer_kinds`): the traced kernels per layer and phase, and the
    kernels ``stack`` runs for them (with TE's unfused attention and the jit fusions ``unfused`` turns
    off, as :func:`~vtrain_plugin.cost.lowering.stacks.map_nodes`); the stage's unique kernels and FLOPs
    on its first row."""
    header = ["stage", "layers", "kind", "fwd/layer", "bwd/layer", "recomp/layer", "stack fwd/bwd/recomp",
              "unique kernels", "TFLOP/micro-batch/rank", "collectives per layer"]
    rows = []
    cp = ContextParallel.of(graph)
    options = {"unfused_attention": unfused_attention, "unfused": unfused}
    for s, costed in zip(graph.stages, with_context_parallel(graph).stages):
        per_stage = [str(len({op.key for b in s.blocks for op in b.ops()})), f"{model_flops(s.blocks, cp) / 1e12:.2f}"]
        kinds = layer_kinds(s, graph.model, costed) or [("-", 0, None, None)]
        for i, (kind, count, layer, costed_layer) in enumerate(kinds):
            counts = Counter(op.phase for op in layer.ops()) if layer else Counter()
            lowered = Counter(n.phase for n in map_nodes(costed_layer.nodes, stack, fp8, **options)
                              if isinstance(n, OpNode)) if costed_layer else Counter()
            rows.append([
                _stage_name(s, graph), str(count), kind, str(counts[Phase.FORWARD]), str(counts[Phase.BACKWARD]),
                str(counts[Phase.RECOMPUTE]),
                f"{lowered[Phase.FORWARD]}/{lowered[Phase.BACKWARD]}/{lowered[Phase.RECOMPUTE]}",
                *(per_stage if i == 0 else ["", ""]),
                _collective_summary(costed_layer) if costed_layer else "-",
            ])
    model, plan = graph.model, graph.parallel
    dims = f"layers={model.num_layers} hidden={model.hidden_size}" if model is not None else "layers=? hidden=?"
    title = (f"model: {graph.name} {dims}  "
             f"parallel: tp={plan.tensor_parallel} pp={plan.pipeline_parallel} "
             f"dp={plan.data_parallel} sp={plan.sequence_parallel} "
             f"vp={plan.virtual_pipeline} recompute={plan.recompute.value}{_cp_label(plan)}"
             f"{_moe_label(graph.model, plan)}  "
             f"micro-batch={graph.micro_batch_size} seq={graph.seq_length}  stack: {stack.value}"
             + ("" if fp8 is None else f" (fp8 {fp8.format.value}, {fp8.recipe.value} scaling)"))
    total = sum(model_flops(s.blocks, cp) for s in graph.stages) * plan.tensor_parallel * plan.context_parallel
    ranks = "TP and CP ranks" if plan.context_parallel > 1 else "TP ranks"
    footer = (f"unique kernels: {len(graph.unique_kernels())}   model FLOPs per micro-batch "
              f"(all {ranks}): {total / 1e12:.1f} TFLOP")
    return "\n".join([title, "", render_table(rows, header), "", footer])


def layer_kinds(stage: StageGraph, model: ModelSpec | None, costed: StageGraph | None = None
                ) -> list[tuple[str, int, Block, Block]]:
    """Each layer kind of ``stage`` (every folded layer template, then the MTP layers of its head):
    its label (:func:`~vtrain_plugin.capture.folding.layer_kind`), how many layers of it the stage
    holds, its traced block, and that block in ``costed`` (the stage as costed, e.g. with its CP
    attention; ``stage`` itself when None)."""
    costed = costed or stage
    nope = model is not None and model.no_rope_freq is not None
    out = [(layer_kind(b, nope_possible=nope), b.count, b, c)
           for b, c in zip(stage.blocks, costed.blocks, strict=True) if b.kind is BlockKind.LAYER]
    for b, c in zip(stage.blocks, costed.blocks, strict=True):
        mtp = mtp_layer(b) if b.kind is BlockKind.HEAD and model is not None and model.mtp_num_layers else None
        if mtp is not None:
            out.append((f"MTP {layer_kind(mtp, nope_possible=nope)}", model.mtp_num_layers, mtp, mtp_layer(c)))
    return out


def _cp_label(plan: ParallelPlan) -> str:
    """`` cp=N (comm)`` under context parallelism, nothing without."""
    return f" cp={plan.context_parallel} ({plan.cp_comm_type.value})" if plan.context_parallel > 1 else ""


def _moe_label(model: ModelSpec | None, plan: ParallelPlan) -> str:
    """`` experts=8 top-2 ep=8 etp=1 dispatcher=alltoall skew=1`` for a MoE model, else ``""``."""
    if model is None or not model.is_moe:
        return ""
    features = [f" shared-expert={model.moe_shared_expert_intermediate_size}"
                + (" (overlapped)" if model.moe_shared_expert_overlap else "")
                if model.moe_shared_expert_intermediate_size is not None else "",
                f" moe-layers={model.num_moe_layers}/{model.num_layers}" if model.has_dense_layers_between_moe else "",
                " grouped-gemm" if model.moe_grouped_gemm else "",
                " permute-fusion" if model.moe_permute_fusion else "",
                " router-fusion" if model.moe_router_fusion else "",
                f" capacity={model.moe_expert_capacity_factor:g}" if model.moe_expert_capacity_factor is not None else ""]
    return (f" experts={model.num_experts} top-{model.router_topk} ep={plan.expert_parallel} etp={plan.expert_tp} "
            f"dispatcher={plan.moe_token_dispatcher.value} skew={model.moe_routing_skew:g}" + "".join(features))


def _stage_name(s: StageGraph, graph: OpGraph) -> str:
    return f"{s.pipeline_rank}" if graph.parallel.virtual_pipeline == 1 else f"{s.pipeline_rank}.{s.chunk}"


def _collective_summary(layer: Block) -> str:
    groups: Counter[tuple[str, str, str, int]] = Counter()
    for c in layer.collectives():
        groups[(c.phase.value[:3], c.kind.value, c.group.value, c.nbytes)] += 1
    return ", ".join(f"{n}x {kind} {group} {_fmt_bytes(nb)} ({phase})"
                     for (phase, kind, group, nb), n in groups.items()) or "-"


def trace_json(graph: OpGraph, stack: SoftwareStack, fp8: Fp8Settings | None = None, *,
               distributed_optimizer: bool = False, grads: Dtype | None = None,
               fp8_param_gather: bool = False, unfused_attention: bool = False,
               unfused: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per stage: the traced ``ops``, the ``stack_kernels`` ``stack`` runs for them (with each layer's
    CP attention under context parallelism, TE's unfused attention and the jit fusions ``unfused``
    turns off), and the ``collectives`` (the traced, the CP attention's and
    the runtime's), identical entries merged with a ``count`` (the DP collectives those of the
    distributed optimizer when ``distributed_optimizer``; gradients in ``grads``, FP8 weights gathered
    with ``fp8_param_gather``, as :func:`~vtrain_plugin.cost.comm.runtime_collectives.runtime_collectives`)."""
    stages = []
    tied = graph.model is not None and graph.model.tied
    for s, costed in zip(graph.stages, with_context_parallel(graph).stages):
        runtime = runtime_collectives(s, graph.parallel, dtype=graph.dtype, tied_embeddings=tied,
                                      distributed_optimizer=distributed_optimizer, grads=grads,
                                      fp8_param_gather=fp8_param_gather).nodes(s)
        ops, _ = _merged([(b.kind.value, b.count, b.nodes) for b in s.blocks])
        derived = [(b.kind.value, b.count, b.nodes) for b in costed.blocks] + [("runtime", 1, runtime)]
        _, collectives = _merged(derived)
        kernels, _ = _merged([(b.kind.value, b.count, map_nodes(b.nodes, stack, fp8, unfused=unfused,
                                                                  unfused_attention=unfused_attention))
                              for b in costed.blocks])
        stages.append({"pipeline_rank": s.pipeline_rank, "chunk": s.chunk, "num_layers": s.num_layers,
                       "layer_kinds": [{"kind": kind, "count": count, "block": block.name}
                                       for kind, count, block, _ in layer_kinds(s, graph.model)],
                       "num_parameters": s.num_parameters, "flops": s.flops(),
                       "ops": ops, "stack_kernels": kernels, "collectives": collectives})
    return {"schema_version": graph.schema_version,
            "model": None if graph.model is None else graph.model.to_dict(), "parallel": graph.parallel.to_dict(),
            "micro_batch_size": graph.micro_batch_size, "seq_length": graph.seq_length,
            "software_stack": stack.value, "fp8": None if fp8 is None else fp8.format.value, "stages": stages}


def _merged(blocks: list[tuple[str, int, tuple]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ops and the collectives of ``(block kind, count, nodes)`` entries, identical ones merged."""
    ops: dict[tuple, dict[str, Any]] = {}
    collectives: dict[tuple, dict[str, Any]] = {}
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
    return list(ops.values()), list(collectives.values())


def estimate_table(run: RunConfig, result: Estimate) -> str:
    """The breakdown table of ``vtrain estimate``."""
    lines = [*plan_lines(run, result), ""]
    total = result.iteration_time_ms
    rows = [[name, f"{ms:,.1f}", f"{100 * ms / total:.1f}%"] for name, ms in result.breakdown_ms.items()]
    rows.append(["iteration", f"{total:,.1f}", "100.0%"])
    lines.append(render_table(rows, ["breakdown (bottleneck stage)", "ms", "share"]))
    lines.append("")
    cost = "n/a" if result.cost_usd is None else f"${result.cost_usd:,.2f} per iteration"
    tokens = "n/a" if result.tokens_per_second is None else f"{result.tokens_per_second:,.0f}"
    counted = "Megatron-LM's FLOP count" if result.model_flops_counted_as == "megatron-lm" else "traced FLOPs"
    lines.append(f"tokens/s {tokens}   model TFLOP/s per GPU {result.tflops_per_gpu:.1f} ({counted})   "
                 f"MFU {100 * result.mfu:.1f}% of {result.mfu_peak}   cost {cost}")
    if result.error_band is not None:
        low, high = result.iteration_time_band_ms
        cost_band = "" if result.cost_band_usd is None else \
            f", {_money(result.cost_band_usd[0])}-{_money(result.cost_band_usd[1])} per iteration"
        lines.append(f"likely {low:,.1f}-{high:,.1f} ms per iteration{cost_band}: {result.error_band.words()}")
    if result.iterations is not None:
        train_cost = "" if result.train_cost_usd is None else f", ${result.train_cost_usd:,.0f}"
        lines.append(f"to train {result.total_tokens:,.0f} tokens: {result.iterations:,} iterations, "
                     f"{result.train_days:,.1f} days, {result.train_gpu_hours:,.0f} GPU-hours{train_cost}"
                     + (" without failures" if result.reliability is not None else ""))
        if result.reliability is not None:
            lines.extend(failures_lines(result.train_totals()))
    lines.append(f"kernel time measured: {100 * result.measured_fraction:.1f}% (rest modeled)")
    peak = max(result.memory_gib, key=lambda m: m.total_gib)
    usable = result.usable_memory_gib
    verdict = "fits" if result.fits_in_memory else "DOES NOT FIT"
    if not result.fits_in_memory and peak.tensors_gib <= usable:
        verdict += f" with the allowance (the tensors alone, {peak.tensors_gib:.1f} GiB, fit)"
    lines.append(f"memory per GPU (peak stage): {peak.total_gib:.1f} GiB of {usable:.1f} GiB usable, {verdict} "
                 f"(allocated {peak.tensors_gib:.1f}: weights {peak.weights_gib:.1f}, gradients {peak.gradients_gib:.1f}, "
                 f"optimizer {peak.optimizer_gib:.1f}, activations {peak.activations_gib:.1f} for "
                 f"{peak.inflight_microbatches} micro-batches in flight, GEMM workspaces {peak.workspaces_gib:.2f}; "
                 f"allowance {peak.allowance_gib:.1f})")
    lines.extend(f"assumed: {line}" for line in result.assumptions)
    if result.largest_unmeasured:
        lines.append("")
        rows = [[k.op, " x ".join(str(list(s)) for s in k.input_shapes), k.phase, k.module, f"{k.time_ms:,.1f}",
                 f"{100 * k.time_ms / total:.1f}%"] for k in result.largest_unmeasured]
        lines.append(render_table(rows, ["largest unmeasured kernels", "shapes", "phase", "module",
                                         "ms/iter on its busiest stage", "of iteration"]))
    return "\n".join(lines)


def _layer_label(model) -> str:
    """The layer choices that differ from the family's (ModelSpec's layer fields that are set)."""
    layer, parts = model.layer, []
    if model.kv_channels is not None:
        parts.append(f"head dim {model.head_dim}")
    if model.normalization is not None:
        parts.append(layer.normalization.value)
    if model.activation is not None or model.gated_linear_unit is not None:
        parts.append(f"{'gated ' if layer.gated_linear_unit else ''}{layer.activation.value} MLP")
    if model.add_bias_linear is not None or model.add_qkv_bias:
        parts.append("QKV bias only" if model.add_qkv_bias else f"linear biases {'on' if layer.add_bias_linear else 'off'}")
    if model.hidden_dropout is not None or model.attention_dropout is not None:
        parts.append(f"dropout {layer.hidden_dropout:g}/{layer.attention_dropout:g}")
    if model.position_embedding_type is not None:
        parts.append(f"positions {layer.position_embedding_type.value}")
    if model.rotary_percent != 1.0:
        parts.append(f"rotary {model.rotary_percent:.0%}")
    parts += ["QK layer norm"] * model.qk_layernorm + ["QK L2 norm"] * model.qk_l2_norm
    parts += ["layernorm-1p"] * model.layernorm_zero_centered_gamma
    if isinstance(model.no_rope_freq, int):
        parts.append("NoPE on every layer" if model.no_rope_freq == 1 else f"NoPE every {model.no_rope_freq} layers")
    elif model.no_rope_freq is not None:
        parts.append(f"NoPE on {sum(model.no_rope_freq)} of {model.num_layers} layers")
    return "".join(f", {p}" for p in parts)


def plan_lines(run: RunConfig, result: Estimate) -> list[str]:
    """The whole plan an estimate was made of, as it was read: model, layout, batch, training."""
    model, plan, training = run.model, run.parallel, run.training
    groups = model.num_query_groups or model.num_attention_heads
    on = {True: "on", False: "off"}
    bucket_nbytes = training.bucket_nbytes(plan.data_parallel, training.grad_dtype(model.dtype).nbytes)
    return [
        f"{run.source}: {model.name or model.family.value} on {result.num_gpus} x {result.gpu}",
        f"  model     {model.family.value}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads, {groups} query groups"
        f"{' (GQA)' if groups != model.num_attention_heads else ''}{_layer_label(model)}, FFN {model.ffn_size}, sequence "
        f"{model.seq_length}, vocabulary {model.vocab_size}, {model.dtype.value}"
        + ("" if result.fp8 is None else f" with fp8 {result.fp8} GEMMs") + ("," if model.is_moe else "")
        + _moe_label(model, plan),
        f"  parallel  tp={plan.tensor_parallel}{_cp_label(plan) or ' cp=1'} pp={plan.pipeline_parallel} "
        f"vp={plan.virtual_pipeline} dp={plan.data_parallel}"
        + ("" if model.is_moe else f" ep={plan.expert_parallel}")
        + f", sequence parallel {on[plan.sequence_parallel]}, recompute {plan.recompute.value}",
        f"  batch     micro-batch {plan.micro_batch_size}, global batch {result.global_batch_size}, "
        f"{result.num_microbatches} micro-batches per replica, schedule {training.schedule.value}",
        f"  training  gradient reduction {training.grad_reduce.value} (buckets {bucket_nbytes / MEGABYTE:g} MB, "
        f"gradients in {training.grad_dtype(model.dtype).value}), "
        f"distributed optimizer {on[result.distributed_optimizer]}"
        + (", parameter all-gather overlapped" if training.overlap_param_gather else "")
        + ("" if result.fsdp is None else f", FSDP {result.fsdp}")
        + f", TP comm overlap {on[training.tp_comm_overlap]}, stack {result.software_stack}"
        + ("" if result.fp8 is None else f", fp8 {result.fp8} ({training.fp8_recipe.value} scaling"
           + (", FP8 weights)" if training.fp8_param_gather else ")")),
    ]


def failures_lines(totals: TrainTotals) -> list[str]:
    """What failures, restarts and checkpoints add to a run (``vtrain estimate --tokens``)."""
    f = totals.failures
    run = f.run
    cost = "" if totals.cost_usd is None else f", ${totals.cost_usd:,.0f}"
    rate = f.reliability
    mode = f"{rate.checkpoint.value} checkpoints of {f.checkpoint_nbytes / GBYTE:,.0f} GB"
    interval = (f"every {f.interval_iterations:,} iterations"
                + (" (Daly's optimum)" if f.interval_chosen else
                   f" (given {f.interval_clamped_from:,}, longer than the run: clamped to its length)"
                   if f.interval_clamped_from is not None else " (given)"))
    hours = {"compute": run.compute_s, "checkpoint stalls": run.checkpoint_s, "lost work": run.lost_s,
             "restarts": run.restart_s}
    return [
        f"with failures: {totals.days:,.1f} days, {totals.gpu_hours:,.0f} GPU-hours{cost}, goodput "
        f"{100 * totals.goodput:.1f}% ({rate.failures.value if rate.failure_rate_per_gpu_hour is None else 'given'}: "
        f"{rate.rate_per_gpu_hour:.3g} failures per GPU-hour, one every {f.mtbf_hours:.3g} h; "
        f"{run.failures:,.0f} expected)",
        f"  {mode} {interval}: write {f.checkpoint.write_s:,.1f} s, stall {f.stall_s:,.1f} s each; "
        f"restart {f.restart_s / SECONDS_PER_MINUTE:,.1f} min (load {f.checkpoint.load_s:,.1f} s)",
        "  wall time: " + ", ".join(f"{name} {seconds / SECONDS_PER_HOUR:,.1f} h ({100 * seconds / run.wall_s:.1f}%)"
                                    for name, seconds in hours.items()),
    ]


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
    memory_error = "n/a" if result.memory_error_pct is None else f"{result.memory_error_pct:+.1f}%"
    lines.append(f"peak memory: predicted {result.peak_memory_predicted_gib:.2f} GiB, measured "
                 f"{result.peak_memory_measured_gib:.2f} GiB, error {memory_error} ({result.memory_measure})")
    lines.append(f"kernel time measured in the prediction: {100 * result.measured_fraction:.1f}%")
    lines.extend(f"warning: {line}" for line in result.warnings)
    if result.measured_fraction < 1.0:
        lines.append("(kernels missing from the profile database were modeled; run `vtrain profile` on this "
                     "device first)")
    return "\n".join(lines)


def _money(usd: float) -> str:
    if math.isnan(usd):
        return "n/a"
    if usd >= 1000:
        return f"${usd:,.0f}"
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.3g}"


def _plan_label(row: Mapping[str, Any]) -> str:
    cp = row.get("context_parallel", 1)
    ep = f"ep={row['expert_parallel']} " if row.get("expert_parallel", 1) > 1 else ""
    return (f"tp={row['tensor_parallel']}{f' cp={cp}' if cp > 1 else ''} pp={row['pipeline_parallel']} "
            f"dp={row['data_parallel']} {ep}"
            f"micro-batch={row['micro_batch_size']} vp={row['virtual_pipeline']} "
            f"sp={'on' if row['sequence_parallel'] else 'off'} recompute={row['recompute']}"
            + (" distributed optimizer" if row["distributed_optimizer"] else ""))


def search_table(result: SearchResult, *, baseline: Mapping[str, Any] | None = None) -> str:
    """The top plans of ``vtrain search`` and a summary line (and the baseline, if any); the software
    stack and FP8 columns appear when the plans differ in them."""
    from vtrain_plugin.planning.space import format_skipped

    table = result.table
    trained = "train_days" in table
    expected = "expected_train_days" in table
    varied = [column for column in ("software_stack", "fp8") if table[column].nunique(dropna=False) > 1]
    experts = bool((table["expert_parallel"] > 1).any())  # an ep column when some plan splits experts
    header = ["rank", "tp", "cp", "pp", "dp", *(["ep"] if experts else []), "mb", "vp", "sp", "recompute",
              "grad reduce", "dist opt", *(_VARIED_HEADERS[c] for c in varied), "GPUs", "iteration ms",
              "likely ms", "tokens/s", "MFU", "memory GiB", "fits", "$/iteration", *(["days", "$ to train"] if trained else []),
              *(["expected days", "expected $", "goodput", "ckpt every"] if expected else []), "front"]
    rows = []
    for row in result.top().to_dict(orient="records"):
        rows.append([
            str(row["rank"]), str(row["tensor_parallel"]), str(row["context_parallel"]), str(row["pipeline_parallel"]),
            str(row["data_parallel"]), *([str(row["expert_parallel"])] if experts else []),
            str(row["micro_batch_size"]), str(row["virtual_pipeline"]), "on" if row["sequence_parallel"] else "off",
            row["recompute"], row["grad_reduce"], "on" if row["distributed_optimizer"] else "off", *(str(row[c] or "off") for c in varied),
            f"{row['num_gpus']:,}", f"{row['iteration_time_ms']:,.1f}", _likely(row),
            f"{row['tokens_per_second']:,.0f}", f"{100 * row['mfu']:.1f}%", f"{row['peak_memory_gib']:.1f}",
            "yes" if row["fits_in_memory"] else "NO", _money(row["cost_usd"]),
            *([f"{row['train_days']:,.1f}", _money(row["train_cost_usd"])] if trained else []),
            *([f"{row['expected_train_days']:,.1f}", _money(row["expected_train_cost_usd"]),
               f"{100 * row['goodput']:.1f}%", f"{row['checkpoint_interval_iterations']:,.0f} it"] if expected else []),
            "*" if row["pareto"] else ""])
    skipped = sum(result.skipped.values())
    lines = [render_table(rows, header), "",
             f"{len(table):,} plans evaluated"
             + (f" (best-first, of {result.num_candidates:,})" if len(table) < result.num_candidates else "")
             + f", {result.num_fitting:,} fit in memory, "
             f"{int(table['pareto'].sum()):,} on the Pareto front (*), ranked by {result.objective}"
             + (f" ({result.time_column if result.objective != 'cost' else result.cost_column})" if trained else "")
             + "; "
             f"skipped {skipped:,}" + (f" ({format_skipped(result.skipped)})" if skipped else "")]
    if baseline is not None:
        lines.append(_baseline_line(result, baseline))
    return "\n".join(lines)


_VARIED_HEADERS = {"software_stack": "stack", "fp8": "fp8"}


def _likely(row: Mapping[str, Any]) -> str:
    """The iteration time a plan likely measures, from its error band (n/a without one)."""
    low, high = row.get("iteration_time_low_ms", math.nan), row.get("iteration_time_high_ms", math.nan)
    return "n/a" if math.isnan(low) else f"{low:,.0f}-{high:,.0f}"


def _baseline_line(result: SearchResult, baseline: Mapping[str, Any]) -> str:
    line = (f"baseline {_plan_label(baseline)} on {baseline['num_gpus']:,} GPUs: "
            f"{baseline['iteration_time_ms']:,.1f} ms, {_money(baseline['cost_usd'])} per iteration"
            + ("" if baseline["fits_in_memory"] else ", DOES NOT FIT in memory"))
    best = result.table.iloc[0]
    if not best["fits_in_memory"]:
        return line
    if result.objective == "time":
        return line + f"; the top plan is {baseline['iteration_time_ms'] / best['iteration_time_ms']:.2f}x faster"
    return line + f"; the top plan costs {best['cost_usd'] / baseline['cost_usd']:.2f}x as much"


def search_csv(table: pd.DataFrame) -> str:
    """Every evaluated plan, one CSV row each (NaN as an empty field)."""
    return table.to_csv(index=False)


def search_jsonl(table: pd.DataFrame) -> str:
    """Every evaluated plan, one JSON object per line (NaN as null)."""
    return "".join(json.dumps({k: _json_value(v) for k, v in row.items()}, allow_nan=False) + "\n"
                   for row in table.to_dict(orient="records"))


def _json_value(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sizing_table(result: SizingResult) -> str:
    """The shapes ``vtrain size`` searched, its answer and the naive fixed-MFU answer."""
    from vtrain_plugin.planning.model_family import describe_ladder

    expected = any(o.plan is not None and "expected_train_days" in o.plan for o in result.evaluated)
    header = ["model", "params", "layers", "hidden", "heads", "tokens", "best plan", "GPUs", "MFU",
              "expected days" if expected else "days", "expected $" if expected else "$ to train",
              *(["goodput"] if expected else []), "within budget"]
    rows = []
    for o in result.evaluated:
        d = o.to_dict()
        plan = (f"tp={d['tensor_parallel']} pp={d['pipeline_parallel']} dp={d['data_parallel']} "
                f"mb={d['micro_batch_size']} {d['recompute']}" if o.plan is not None
                else "none fits" if o.floor_days is None else "none costed: every floor over budget")
        mark = " <- answer" if o.model == result.answer.model else ""
        if result.naive is not None and o.model == result.naive.model:
            mark += " <- naive"
        rows.append([d["model"], f"{d['num_parameters'] / 1e9:,.2f}B", str(d["num_layers"]), str(d["hidden_size"]),
                     str(d["num_attention_heads"]), f"{d['tokens'] / 1e9:,.1f}B", plan,
                     f"{d['num_gpus']:,}" if o.plan is not None else "",
                     f"{100 * d['mfu']:.1f}%" if o.plan is not None else "",
                     _days(o.train_days) if o.plan is not None
                     else f"> {_days(o.floor_days)}" if o.floor_days is not None else "",
                     _money(o.train_cost_usd) if o.plan is not None else "",
                     *([f"{100 * d['goodput']:.1f}%" if o.plan is not None else ""] if expected else []),
                     ("yes" if o.within_budget else "no") + mark])
    budget = " and ".join(part for part in (f"{result.days:g} days" if result.days is not None else "",
                                            f"${result.budget_usd:,.0f}" if result.budget_usd is not None else "")
                          if part)
    answer = result.answer
    lines = [f"ladder: {describe_ladder(result.answer.model)}", "", render_table(rows, header), "",
             *(["days and dollars expected with failures, restarts and checkpoints (--failures off: "
                "failure-free)"] if expected else []),
             f"largest model within {budget}: {answer.model.name}, {answer.model.num_parameters / 1e9:,.2f}B "
             f"parameters on {answer.tokens / 1e9:,.1f}B tokens, {_days(answer.train_days)} days"
             + (f", {_money(answer.train_cost_usd)}" if not math.isnan(answer.train_cost_usd) else "")]
    if result.naive is not None:
        naive = result.naive_outcome
        verdict = (f"vtrain: {_days(naive.train_days)} days" if naive.plan is not None
                   else f"vtrain: more than {_days(naive.floor_days)} days" if naive.floor_days is not None
                   else "vtrain: no plan fits")
        lines.append(f"naive answer at a fixed {100 * result.naive_mfu:.0f}% MFU: {naive.model.name}, "
                     f"{naive.model.num_parameters / 1e9:,.2f}B parameters ({verdict}"
                     + ("" if naive.within_budget else ", over budget") + ")")
    return "\n".join(lines)


def _days(days: float) -> str:
    return f"{days:,.1f}" if days >= 10 else f"{days:.3g}"

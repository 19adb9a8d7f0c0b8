"""The kernel model against kernels profiled on a GPU, by op class, for the ground-truth plans.

    .venv/bin/python -m benchmarks.accuracy.kernel_classes [--plans NAME,...] [--profiles benchmarks/results/h100_profiles.json]
        [--gpu h100-sxm] [--top 12]

Where does the analytical estimate of ``h100_validation.py``'s plans go wrong? Each plan (its
one-device run, as the real step trains it) is traced here, every unique kernel is looked up in the
profile export measured on the card and timed by the kernel model the estimator uses (the device's
``default`` calibration), and the totals of one micro-batch plus the optimizer step (each kernel
times how often it runs) are printed per op class and op: analytic against measured, and the error.
The iteration-level comparison is ``h100_validation.csv``; this says which kernels make it up.

``--script-plan NAME`` does the same for a plan of ``benchmarks/device/trace_in_script.py`` (the MoE
layer ``moe-0.9b``: ``--script-plan moe-0.9b --gpu h200-sxm --profiles
benchmarks/results/h200_trace_in_script_profiles.json``), traced as the ModelSpec its script's
GPTModel reads as, and adds the totals by part of the layer (attention, the MoE router, the
permutation, the experts, the optimizer, the rest) with the measured time of the kernels under
:data:`LAUNCH_BOUND_US`: a replay times the launch of a small kernel with it (the device is idle
when each repetition is issued), about 30 us on the H200's host where its sweep's streaming
kernels take 4-6 us on the device.

``--by-size`` prints the memory-bound kernels (neither GEMM nor attention) by bytes moved instead:
measured against modelled, and the bandwidth reached, as a share of the datasheet's weighted by
time; then the two constants of the memory-bound model (``kernel_overhead_ns`` and
``hbm_efficiency``) fitted to the streaming sweep (``h100_kernel_sweep.csv``) and its error by size.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

from vtrain_plugin.cli.render import render_table

RESULTS = Path(__file__).resolve().parents[1] / "results"


LAUNCH_BOUND_US = 60.0  # a replayed kernel measured under this is taken as bound by its launch (module doc)


def class_totals(name: str, mapping: dict, gpu: str, db_path: Path) -> tuple[dict[str, list[float]], int, int]:
    """``op class:op -> [analytic ns, measured ns, kernels]`` over the plan's measured kernels, with
    the counts of unique and of measured kernels."""
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.measured import one_device
    from vtrain_plugin.runs import run_config_from_dict, with_gpu

    run = run_config_from_dict(mapping, source=name)
    single, _ = one_device.single_device_run(run, "cpu")
    single = with_gpu(single, gpu)  # the one-device run of the card the profiles are from
    return graph_class_totals(trace(single.model, single.parallel), gpu, db_path)


def script_plan_graph(name: str):
    """The graph of ``trace_in_script.py``'s plan ``name`` as its script traces it: the ModelSpec
    and plan its GPTModel (bf16, as built on the GPU) reads as, without building the model."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.device.trace_in_script import PLANS
    from megatron_adapters.config_map import parallel_plan_from_transformer_config
    from megatron_adapters.gpt_model import model_spec_of_gpt_model
    from vtrain_plugin.capture.tracer import trace

    config_fields, model_fields, micro_batch, _ = PLANS[name]
    fields = dict(config_fields)
    if fields.get("gated_linear_unit"):
        fields["activation_func"] = torch.nn.functional.silu
    config = TransformerConfig(**fields, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    gpt = SimpleNamespace(config=config, vocab_size=model_fields["vocab_size"],
                          position_embedding_type=model_fields["position_embedding_type"],
                          share_embeddings_and_output_weights=model_fields["share_embeddings_and_output_weights"])
    model = model_spec_of_gpt_model(gpt, seq_length=model_fields["max_sequence_length"])
    plan = replace(parallel_plan_from_transformer_config(config, None), micro_batch_size=micro_batch)
    return trace(model, plan)


def graph_class_totals(graph, gpu: str, db_path: Path) -> tuple[dict[str, list[float]], int, int]:
    """:func:`class_totals` of a traced graph."""
    from profiler.lookup import measured_durations
    from vtrain_plugin.core.op_names import parse_op_name
    from vtrain_plugin.cost.kernels.model import KernelModel
    from vtrain_plugin.cost.kernels.op_classes import classify
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device

    device = get_device(gpu)
    model = KernelModel(device, calibration_for(device.name, "default").constants)
    unique = graph.unique_kernels()
    measured = measured_durations(list(unique), gpu, db_path=db_path)
    example = {op.key: op for s in graph.stages for b in s.blocks for op in b.ops()}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for key, kernel in unique.items():
        if key not in measured:
            continue
        label = f"{classify(key.op).value}: {parse_op_name(key.op).base}"
        totals[label][0] += model.duration_ns(example[key]) * kernel.count
        totals[label][1] += measured[key] * kernel.count
        totals[label][2] += kernel.count
    return totals, len(unique), len(measured)


def part_of(module: str, phase) -> str:
    """The part of a layer an op of ``module`` belongs to (its MoE pieces apart)."""
    from vtrain_plugin.core.graph import Phase

    if phase is Phase.OPTIMIZER:
        return "optimizer"
    if ".mlp.router" in module:
        return "moe: router (gating GEMM, softmax, top-k, aux loss)"
    if ".mlp.experts" in module:
        return "moe: experts (per-expert GEMMs, activation)"
    if module.endswith(".mlp") or ".mlp.token_dispatcher" in module:
        return "moe: permutation (index_select, scatter_add, ...)"
    if ".mlp" in module:
        return "mlp"
    if ".self_attention" in module:
        return "attention"
    return "rest (norms, embedding, loss, residuals)"


def part_totals(graph, gpu: str, db_path: Path) -> dict[str, list[float]]:
    """``part -> [analytic ns, measured ns, kernels, launch-bound kernels, their analytic ns, their
    measured ns]`` over the measured kernels of one micro-batch and the optimizer step."""
    from profiler.lookup import measured_durations
    from vtrain_plugin.cost.kernels.model import KernelBatch, KernelKind, KernelModel
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device

    device = get_device(gpu)
    model = KernelModel(device, calibration_for(device.name, "default").constants)
    measured = measured_durations(list(graph.unique_kernels()), gpu, db_path=db_path)
    ops = [(op, b.count) for s in graph.stages for b in s.blocks for op in b.ops()]
    batch = KernelBatch.of([op for op, _ in ops])
    analytic = model.device_ns(batch)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0, 0.0, 0.0])
    for (op, count), kind, ns in zip(ops, batch.kind, analytic):
        if kind == KernelKind.NONE or op.key not in measured:
            continue
        t = totals[part_of(op.module, op.phase)]
        m = measured[op.key]
        t[0] += ns * count
        t[1] += m * count
        t[2] += count
        if m < LAUNCH_BOUND_US * 1e3:
            t[3] += count
            t[4] += ns * count
            t[5] += m * count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1][1]))


def part_rows(totals: dict[str, list[float]]) -> list[list[str]]:
    def row(label: str, a: float, m: float, n: int, nb: int, ab: float, mb: float) -> list[str]:
        return [label, f"{n:,}", f"{a / 1e6:,.2f}", f"{m / 1e6:,.2f}", f"{100 * (a / m - 1):+.0f}", f"{nb:,}",
                f"{ab / 1e6:,.2f}", f"{mb / 1e6:,.2f}"]

    return ([row(part, *values) for part, values in totals.items()]
            + [row("all", *(sum(c) for c in zip(*totals.values())))])


SIZE_EDGES_MIB = (0, 1, 16, 64, 256, 1 << 20)


def kernel_rows(name: str, mapping: dict, gpu: str, db_path: Path) -> list[tuple[float, float, float, int]]:
    """``(nbytes, modelled ns, measured ns, count)`` of the plan's measured memory-bound kernels."""
    from profiler.lookup import measured_durations
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.cost.kernels.model import KernelBatch, KernelKind, KernelModel
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device
    from vtrain_plugin.measured import one_device
    from vtrain_plugin.runs import run_config_from_dict, with_gpu

    device = get_device(gpu)
    model = KernelModel(device, calibration_for(device.name, "default").constants)
    single, _ = one_device.single_device_run(run_config_from_dict(mapping, source=name), "cpu")
    graph = trace(with_gpu(single, gpu).model, single.parallel)
    unique = graph.unique_kernels()
    measured = measured_durations(list(unique), gpu, db_path=db_path)
    example = {op.key: op for s in graph.stages for b in s.blocks for op in b.ops()}
    out = []
    for key, kernel in unique.items():
        batch = KernelBatch.of([example[key]])
        if key in measured and batch.kind[0] == KernelKind.OTHER:
            out.append((float(batch.nbytes[0]), float(model.device_ns(batch)[0]), measured[key], kernel.count))
    return out


def size_rows(kernels: list[tuple[float, float, float, int]], hbm_gbytes_per_s: float) -> list[list[str]]:
    import numpy as np

    out = []
    for low, high in zip(SIZE_EDGES_MIB, SIZE_EDGES_MIB[1:]):
        sel = [k for k in kernels if low * 2**20 <= k[0] < high * 2**20]
        if not sel:
            continue
        nbytes, model, meas, count = (np.array(c, float) for c in zip(*sel))
        out.append([f"{low:,}-{high:,} MiB" if high < 1 << 20 else f">= {low:,} MiB", f"{len(sel)}",
                    f"{np.median(meas) / 1e3:.1f}", f"{np.median(model) / 1e3:.1f}",
                    f"{100 * ((model * count).sum() / (meas * count).sum() - 1):+.0f}",
                    f"{(nbytes * count).sum() / (meas * count).sum() / hbm_gbytes_per_s:.2f}"])
    return out


def sweep_fit(sweep: Path, hbm_gbytes_per_s: float) -> str:
    """``t = overhead + nbytes / (bandwidth * efficiency)`` fitted to the sweep's streaming kernels
    (least squares on the relative error), and its error by size."""
    import csv

    import numpy as np

    rows = [r for r in csv.DictReader(sweep.open()) if r["kind"] == "stream"]
    nbytes = np.array([float(r["bytes"]) for r in rows])
    ns = np.array([float(r["median_us"]) * 1e3 for r in rows])
    a = np.c_[np.ones_like(nbytes), nbytes / hbm_gbytes_per_s] / ns[:, None]
    (overhead, inverse), *_ = np.linalg.lstsq(a, np.ones_like(ns), rcond=None)
    err = (overhead + inverse * nbytes / hbm_gbytes_per_s) / ns - 1
    table = [[f"{low:,}-{high:,} MiB" if high < 1 << 20 else f">= {low:,} MiB", f"{sel.sum()}",
              f"{100 * np.abs(err[sel]).mean():.1f}", f"{100 * err[sel].mean():+.1f}"]
             for low, high in zip(SIZE_EDGES_MIB, SIZE_EDGES_MIB[1:])
             if (sel := (nbytes >= low * 2**20) & (nbytes < high * 2**20)).any()]
    return (f"streaming sweep ({len(rows)} kernels): kernel_overhead_ns {overhead:.0f}, hbm_efficiency "
            f"{1 / inverse:.3f}\n" + render_table(table, ["bytes", "kernels", "MAPE %", "bias %"]))


def rows(totals: dict[str, list[float]], top: int) -> list[list[str]]:
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][1])
    out = [[label, f"{n:,}", f"{a / 1e6:,.2f}", f"{m / 1e6:,.2f}", f"{100 * (a / m - 1):+.0f}"]
           for label, (a, m, n) in ordered[:top] if m > 0]
    a, m = sum(v[0] for v in totals.values()), sum(v[1] for v in totals.values())
    return out + [["all", f"{sum(v[2] for v in totals.values()):,}", f"{a / 1e6:,.2f}", f"{m / 1e6:,.2f}",
                   f"{100 * (a / m - 1):+.0f}"]]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.device.h100_validation import PLANS
    from profiler.db import ProfileDB

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", default="qwen3-0.6b_mb1_none,mla-0.5b_mb1_none,ci-gpt-126m_mb4_none",
                        help=f"comma-separated, of: {', '.join(PLANS)}")
    parser.add_argument("--profiles", type=Path, default=RESULTS / "h100_profiles.json")
    parser.add_argument("--gpu", default="h100-sxm", help="device preset the profiles were measured on")
    parser.add_argument("--top", type=int, default=12, help="op classes shown per plan, by measured time")
    parser.add_argument("--by-size", action="store_true", help="memory-bound kernels by bytes moved (see above)")
    parser.add_argument("--sweep", type=Path, default=RESULTS / "h100_kernel_sweep.csv")
    parser.add_argument("--script-plan", default=None,
                        help="a plan of benchmarks/device/trace_in_script.py instead of --plans, by part too (see above)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        parser.error(f"--plans: unknown plan {unknown[0]!r}")
    if args.script_plan is not None:
        from benchmarks.device.trace_in_script import PLANS as SCRIPT_PLANS

        if args.script_plan not in SCRIPT_PLANS:
            parser.error(f"--script-plan: unknown plan {args.script_plan!r}; one of {', '.join(SCRIPT_PLANS)}")
    overall: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "profiles.sqlite"
        with ProfileDB.open(db_path) as db:
            db.import_(args.profiles)
        if args.script_plan is not None:
            graph = script_plan_graph(args.script_plan)
            totals, n_unique, n_measured = graph_class_totals(graph, args.gpu, db_path)
            print(f"{args.script_plan}: {n_measured} of {n_unique} unique kernels profiled; one micro-batch and "
                  f"the optimizer step, ms")
            print(render_table(rows(totals, args.top), ["op class: op", "kernels", "analytic", "measured", "err %"]))
            print(f"\nby part; launch-bound: the kernels measured under {LAUNCH_BOUND_US:g} us")
            print(render_table(part_rows(part_totals(graph, args.gpu, db_path)),
                               ["part", "kernels", "analytic", "measured", "err %", "launch-bound kernels",
                                "their analytic", "their measured"]))
            return 0
        if args.by_size:
            from vtrain_plugin.hardware.devices import get_device

            hbm = get_device(args.gpu).hbm_bytes_per_ns
            kernels = [k for name in names for k in kernel_rows(name, PLANS[name], args.gpu, db_path)]
            print(f"memory-bound kernels of {', '.join(names)}, {args.gpu} ({hbm:,.0f} GB/s datasheet)")
            print(render_table(size_rows(kernels, hbm), ["bytes", "kernels", "measured us (median)",
                                                         "analytic us (median)", "err % (by time)",
                                                         "share of HBM (by time)"]))
            print("\n" + sweep_fit(args.sweep, hbm))
            return 0
        for name in names:
            totals, n_unique, n_measured = class_totals(name, PLANS[name], args.gpu, db_path)
            print(f"\n{name}: {n_measured} of {n_unique} unique kernels profiled; one micro-batch and the "
                  f"optimizer step, ms")
            print(render_table(rows(totals, args.top), ["op class: op", "kernels", "analytic", "measured", "err %"]))
            for label, values in totals.items():
                for i in range(3):
                    overall[label][i] += values[i]
    print(f"\nall {len(names)} plans")
    print(render_table(rows(overall, args.top), ["op class: op", "kernels", "analytic", "measured", "err %"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Make the shipped calibration files: one joint fit of every published set, by vtrain's own fitter.

``.venv/bin/python -m benchmarks.accuracy.calibrate --into-package`` traces the six published sets
(vTrain's A100 single- and multi-node runs, SC'21, NeMo H100, NeMo B200, the Megatron-LM functional
tests; a few minutes on two cores, seconds once the trace cache holds them) and fits them at once
with :func:`vtrain_plugin.measured.calibrate.fit_constants`, the fitter of ``vtrain calibrate``:
bounded least squares on the log error, every constant inside
:func:`~vtrain_plugin.hardware.calibration.constant_range`, each set weighing the same, a host cost
one value per software stack (on every GPU), a device constant one value per GPU, the network
efficiency and the spread of GPU speeds one value for every cluster (:data:`SHARED`). No term
belongs to one run or one model size; the functional tests of megatron-core's local spec fit
that stack's host costs (``megatron_core_local``). Then it reports, per set, the calibration MAPE and bias (the
functional tests per GPU and deterministic or not), leave-out refits (per test case, per model
size, per run of the small sets; each the joint fit redone without the runs left out, started from
it: :func:`~vtrain_plugin.measured.calibrate.leave_out_refits`, to convergence or
``--leave-out-steps`` trust-region steps), the bias by scale (GPUs x parameters) and every
constant that ends on a bound of its range. ``--dry-run`` writes nothing; otherwise each fitted
(device, stack) file is written, and the files that take their constants from a fitted GPU
(:data:`DERIVED`) or a fitted GPU and stack (:data:`CROSSED`) get them too, saying why; every GPU's
``default`` file (the eager ``local_spec`` stack's) gets megatron-core's layer host costs
(:func:`eager_default_files`), its device constants kept.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.accuracy import a100_data, b200_data, ci_data, h100_data, sc21_data
from benchmarks.accuracy.a100_data import SOURCE_LABELS, MeasuredRun, add_data_argument, error_stats, prepare_runs

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.hardware.calibration import (DEFAULT_STACK, OPTIONAL_CONSTANTS, SOFTWARE_CONSTANTS, Calibration,
                                                DeviceConstants, calibration_for, package_calibration_dir,
                                                write_calibration)
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.measured.calibrate import (JointFit, JointSpace, MeasuredPlan, fit_constants, leave_out_refits,
                                              scope_of)

SETS: dict[str, Callable[[Path], list[MeasuredRun]]] = {
    "single": lambda d: a100_data.read_runs(d, which=("single",)),
    "multi": lambda d: a100_data.read_runs(d, which=("multi",)),
    "sc21": sc21_data.read_runs, "h100": h100_data.read_runs, "b200": b200_data.read_runs, "ci": ci_data.read_runs}

# What is fitted: every host cost of each stack, the device constants of each GPU, the two network ones.
FITTED = ("gemm_efficiency", "hbm_efficiency", "kernel_overhead_ns", "attention_efficiency", "host_overhead_ns",
          "module_host_overhead_ns", "layer_host_overhead_ns", "collective_host_overhead_ns",
          "microbatch_overhead_ns", "iteration_overhead_ns", "host_time_factor", "network_efficiency",
          "gpu_speed_spread")
# One value for every cluster of the sets: InfiniBand's share of line rate through NCCL and the
# spread of nominally equal GPUs are the data centre's, and the H100 and B200 sets have too few
# multi-node runs to tell their own apart.
SHARED = ("network_efficiency", "gpu_speed_spread")
# (constant, scope) left at the shipped value: what a set cannot inform. B200's three runs inform its
# GEMM and attention rates; the kernel overhead and HBM efficiency of its few long kernels are not seen.
# The host costs stand for a DGX H100's CPU (host_time_factor 1 there, the reference); a DGX B200's
# Xeon 8570 is as fast per core, and B200's long kernels could not tell.
FIXED = (("hbm_efficiency", "b200-sxm"), ("kernel_overhead_ns", "b200-sxm"), ("host_time_factor", "h100-sxm"),
         ("host_time_factor", "b200-sxm"))
_SAME_A100 = "the same GA100 die and DGX A100 host; its HBM efficiency is the same fraction of its own 1555 GB/s"
_SAME_H100 = ("the same GH100 die with the same 989 TFLOP/s, kernels and DGX host; its HBM efficiency is the same "
              "fraction of its own 4.8 TB/s")
# Files whose constants are those of a fitted (device, stack), and why.
DERIVED = {
    ("a100-sxm4-40gb", "megatron_core_te"): (("a100-sxm4-80gb", "megatron_core_te"), _SAME_A100),
    ("h200-sxm", "megatron_core_te"): (("h100-sxm", "megatron_core_te"), _SAME_H100),
    ("a100-sxm4-40gb", "megatron_core_local"): (("a100-sxm4-80gb", "megatron_core_local"), _SAME_A100),
    ("h200-sxm", "megatron_core_local"): (("h100-sxm", "megatron_core_local"), _SAME_H100),
    ("gb200", "megatron_core_te"): (("b200-sxm", "megatron_core_te"),
                                    "the B200's Blackwell tensor cores, memory and software at a higher clock and power "
                                    "limit, efficiencies being fractions of its own peaks; no published GB200 run"),
    ("gb300", "megatron_core_te"): (("b200-sxm", "megatron_core_te"),
                                    "the B200's Blackwell tensor cores, memory and software at a higher clock and power "
                                    "limit, efficiencies being fractions of its own peaks; no published GB300 run")}
# Files of a stack on a fitted GPU that no published run ran it on: the GPU's device constants of the
# fit with the stack's host costs (software constants: the same on every GPU), and why they ship.
CROSSED = {("h100-sxm", "megatron_deepspeed_2023"): "the legacy Megatron GPT (--use-legacy-models) on an H100"}
# The eager stack (``local_spec``: megatron-core's local spec as traced, unfused, what vtrain's real
# one-GPU step trains) has no file of its own: on every GPU it runs on the ``default`` file. Its host
# costs are those of megatron-core's layers, which the fit gives ``megatron_core_local`` (the same Python
# modules, autograd and launch path; the trace counts the unfused kernels themselves), without the
# Megatron-LM loop's per-micro-batch and per-iteration costs (the real step runs no such loop).
EAGER_HOST_FROM = "megatron_core_local"
EAGER_HOST = ("host_overhead_ns", "backward_host_overhead_ns", "module_host_overhead_ns", "layer_host_overhead_ns",
              "collective_host_overhead_ns")
# Where a default file's source (and command) turn from its device constants to its host costs.
HOST_NOTE = " Host costs: "
GPU_BUCKETS = ((8, "8 GPUs"), (64, "9-64"), (512, "65-512"), (4096, "513-4,096"))
SIZE_BUCKETS = ((1e9, "< 1B"), (10e9, "1-10B"), (100e9, "10-100B"), (math.inf, "> 100B"))
# runs: a set this small is also reported leaving out one run at a time (SC'21, NeMo, and the 26
# multi-node vTrain runs, whose one model size makes leave-one-model-size-out leave the whole set out)
SMALL_SET = 30
HEADER = ["set", "evaluation", "runs", "MAPE %", "median %", "p90 %", "bias %"]


def scope(name: str, plan: MeasuredPlan) -> str:
    return "every cluster" if name in SHARED else scope_of(name, plan)


def measured_plans(runs: Sequence[MeasuredRun]) -> list[MeasuredPlan]:
    out = []
    for p in prepare_runs(runs):
        device, stack = p.run.cluster.gpu, p.prepared.stack.value
        out.append(MeasuredPlan(label=p.measured.name or p.run.model.name or p.measured.source, run=p.run,
                                prepared=p.prepared, measured_ms=p.measured.measured_ms, device=device, stack=stack,
                                base=calibration_for(device, stack).constants, data_set=p.measured.source))
    return out


def stats_row(data_set: str, evaluation: str, predicted: np.ndarray, measured: np.ndarray) -> list[str]:
    s = error_stats(predicted, measured)
    return [data_set, evaluation, str(s.count), f"{s.mape:.2f}", f"{s.median:.2f}", f"{s.p90:.2f}", f"{s.bias:+.2f}"]


def leave_out(fit: JointFit, plans: Sequence[MeasuredPlan], keys: dict[str, Callable[[int], object]],
              max_steps: int | None, verbose: int = 0) -> dict[str, np.ndarray]:
    """Per name of ``keys``: each plan predicted by the fit redone without every plan of its key
    (:func:`~vtrain_plugin.measured.calibrate.leave_out_refits`, real refits); a plan whose key is
    None keeps the fit's prediction (not reported), and a group shared by two keys is refitted once."""
    full = np.array([p.predict_ms(fit.constants(p)) for p in plans])
    groups: dict[str, list[list[int]]] = {}
    for name, key in keys.items():
        members: dict[object, list[int]] = {}
        for i in range(len(plans)):
            if key(i) is not None:
                members.setdefault(key(i), []).append(i)
        groups[name] = list(members.values())
    every = [g for name in keys for g in groups[name]]
    refits = dict(zip(map(frozenset, every),
                      leave_out_refits(fit, plans, every, max_steps=max_steps, verbose=verbose)))
    out = {}
    for name in keys:
        out[name] = full.copy()
        for group in groups[name]:
            for i in group:
                out[name][i] = plans[i].predict_ms(refits[frozenset(group)].constants(plans[i]))
    return out


def size_of(plan: MeasuredPlan) -> tuple[int, int]:
    return plan.run.model.hidden_size, plan.run.model.num_layers


def bucket(value: float, buckets: Sequence[tuple[float, str]]) -> str:
    return next(label for bound, label in buckets if value <= bound)


def bias_by_scale(plans: Sequence[MeasuredPlan], predicted: np.ndarray, measured: np.ndarray) -> str:
    cells: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(plans):
        cells.setdefault((bucket(p.run.parallel.world_size, GPU_BUCKETS),
                          bucket(p.run.model.num_parameters, SIZE_BUCKETS)), []).append(i)
    rows = [[gpus, *(f"{error_stats(predicted[cells[gpus, size]], measured[cells[gpus, size]]).bias:+.1f}% "
                     f"({len(cells[gpus, size])})" if (gpus, size) in cells else "-" for _, size in SIZE_BUCKETS)]
            for _, gpus in GPU_BUCKETS]
    return render_table(rows, ["GPUs", *(label for _, label in SIZE_BUCKETS)])


def report(fit: JointFit, plans: Sequence[MeasuredPlan], *, test_cases: bool = True,
           max_steps: int | None = None) -> str:
    """The per-set table, constants and bias by scale; ``test_cases``: also leave out each functional
    test case; ``max_steps``: the leave-out refits' bound on trust-region steps (None: to convergence)."""
    measured = np.array([p.measured_ms for p in plans])
    predicted = np.array([p.predict_ms(fit.constants(p)) for p in plans])
    sizes = {s: sum(p.data_set == s for p in plans) for s in dict.fromkeys(p.data_set for p in plans)}
    by = leave_out(fit, plans, {
        "size": lambda i: (plans[i].data_set, size_of(plans[i])),
        "case": lambda i: (((plans[i].data_set, ci_data.test_case_of(plans[i].label)) if test_cases else None)
                           if plans[i].data_set == "ci"
                           else (plans[i].data_set, i) if sizes[plans[i].data_set] <= SMALL_SET else None)},
        max_steps=max_steps, verbose=1)
    by_size, by_case = by["size"], by["case"]
    rows = []
    for data_set in dict.fromkeys(p.data_set for p in plans):
        idx = [i for i, p in enumerate(plans) if p.data_set == data_set]
        label = SOURCE_LABELS[data_set]
        rows.append(stats_row(label, "calibration", predicted[idx], measured[idx]))
        if data_set == "ci":
            for name, pick in (("TransformerEngine", lambda p: p.stack == "megatron_core_te"),
                               ("local spec", lambda p: p.stack == "megatron_core_local"),
                               ("A100", lambda p: p.device.startswith("a100")), ("H100", lambda p: p.device == "h100-sxm"),
                               ("deterministic", lambda p: p.run.training.deterministic),
                               ("non-deterministic", lambda p: not p.run.training.deterministic)):
                sub = [i for i in idx if pick(plans[i])]
                rows.append(stats_row(f"  {name}", "calibration", predicted[sub], measured[sub]))
            if test_cases:
                rows.append(stats_row(label, "leave-one-test-case-out", by_case[idx], measured[idx]))
                for name in ("A100", "H100"):
                    sub = [i for i in idx if plans[i].label.endswith(f"({name})")]
                    rows.append(stats_row(f"  {name}", "leave-one-test-case-out", by_case[sub], measured[sub]))
        elif len(idx) <= SMALL_SET:
            rows.append(stats_row(label, "leave-one-run-out", by_case[idx], measured[idx]))
        rows.append(stats_row(label, "leave-one-model-size-out", by_size[idx], measured[idx]))
    constants = [[fit.space.label(p), f"{fit.value(p):.6g}", f"[{low:g}, {high:g}]",
                  "on its bound" if p in fit.on_bound() else ""] for p, (low, high) in fit.space.ranges.items()]
    return "\n\n".join([
        "fitted constants\n" + render_table(constants, ["constant (scope)", "fitted", "range", ""]),
        "per set\n" + render_table(rows, HEADER),
        "signed bias by scale, every run, calibration\n" + bias_by_scale(plans, predicted, measured),
        "signed bias by scale, every run, leave-one-model-size-out\n" + bias_by_scale(plans, by_size, measured)])


def write_files(fit: JointFit, plans: Sequence[MeasuredPlan], command: str, into_package: bool) -> list[Path]:
    """Each fitted (device, stack) file, and the files :data:`DERIVED` from one, with the fitted constants."""
    fitted: dict[tuple[str, str], MeasuredPlan] = {}
    for p in plans:
        fitted.setdefault((p.device, p.stack), p)
    sets = ", ".join(f"{SOURCE_LABELS[s]} ({sum(p.data_set == s for p in plans)})"
                     for s in dict.fromkeys(p.data_set for p in plans))
    paths = []
    for (device, stack), plan in fitted.items():
        constants = fit.constants(plan)
        own = sorted({SOURCE_LABELS[p.data_set] for p in plans if (p.device, p.stack) == (device, stack)})
        source = (f"Joint fit of {len(plans)} published runs ({sets}; benchmarks/data, each set weighted equally) by "
                  f"vtrain's fitter (bounded least squares on the log error, each constant inside its documented "
                  f"range; host costs one value per software stack, device constants one per GPU, network "
                  f"efficiency and GPU speed spread one for every cluster). Runs of this file fitted: "
                  f"{', '.join(own) or 'none (the stack host costs and the GPU device constants of the fit)'}.")
        paths.append(write_calibration(Calibration(device=device, software_stack=stack, source=source, command=command,
                                                   constants=constants), into_package=into_package))
        for (other, other_stack), (origin, why) in DERIVED.items():
            if origin == (device, stack):
                derived = (f"The constants of {device}/{stack}.json, from the same joint fit, not fitted on runs of "
                           f"this GPU: {why}.")
                paths.append(write_calibration(Calibration(device=other, software_stack=other_stack, source=derived,
                                                           command=command, constants=constants),
                                               into_package=into_package))
    by_device = {device: fit.constants(plan) for (device, _), plan in fitted.items()}
    by_stack = {stack: fit.constants(plan) for (_, stack), plan in fitted.items()}
    if EAGER_HOST_FROM in by_stack:
        factors = {device: c.host_time_factor for device, c in by_device.items()}
        for (other, _), ((origin, _), _) in DERIVED.items():
            if origin in factors:
                factors.setdefault(other, factors[origin])
        paths += eager_default_files(by_stack[EAGER_HOST_FROM], command, into_package, host_factors=factors)
    for (device, stack), why in CROSSED.items():
        host = {name: getattr(by_stack[stack], name) for name in SOFTWARE_CONSTANTS}
        crossed = (f"The device constants of {device} and the host costs of {stack} from the same joint fit, for "
                   f"{why}: no published run of this pair.")
        paths.append(write_calibration(Calibration(device=device, software_stack=stack, source=crossed, command=command,
                                                   constants=replace(by_device[device], **host)),
                                       into_package=into_package))
    return paths


def eager_default_files(host: DeviceConstants, command: str, into_package: bool,
                        host_factors: Mapping[str, float] | None = None) -> list[Path]:
    """The package's ``default`` file of every GPU with its device constants kept and the eager stack's
    host costs (:data:`EAGER_HOST`) set to ``host``'s, the loop's left out (neutral).

    ``host_factors`` (device -> ``host_time_factor``, the fit's) sets how much slower than a DGX H100's
    the CPU of each GPU's usual node runs those costs: a property of the node, not of the stack, so the
    eager stack on an A100 pays the DGX A100's factor as its fitted stacks do. A device it does not
    name keeps its file's.
    """
    paths = []
    for path in sorted(package_calibration_dir().glob(f"*/{DEFAULT_STACK}.json")):
        data = json.loads(path.read_text())
        device = data["device"]
        if get_device(device).host_runs_kernels:  # a CPU's host costs are measured on it
            continue
        kept = {k: v for k, v in data["constants"].items() if k not in SOFTWARE_CONSTANTS}
        factor = (host_factors or {}).get(device)
        if factor is not None and factor != OPTIONAL_CONSTANTS["host_time_factor"]:
            kept["host_time_factor"] = factor
        elif factor is not None:
            kept.pop("host_time_factor", None)
        constants = DeviceConstants(**kept, **{name: getattr(host, name) for name in EAGER_HOST})
        node = (f"; host_time_factor {kept['host_time_factor']:.3f}, the fit's for this GPU's node CPU"
                if "host_time_factor" in kept else "")
        note = (f"those of megatron-core's layers, as the joint fit gives {EAGER_HOST_FROM} ("
                + ", ".join(f"{name} {getattr(host, name):.0f}" for name in EAGER_HOST) + node
                + "): the local_spec stack (megatron-core's local spec as traced, eager PyTorch) runs on this file "
                  "on a GPU, the same Python modules, autograd and launch path, its unfused kernels counted by the "
                  "trace; no per-micro-batch or per-iteration loop cost (vtrain's real one-GPU step runs no "
                  "Megatron-LM loop). See docs/accuracy.md, 'Eager steps on Hopper'.")
        source = data["source"].split(HOST_NOTE, 1)[0] + HOST_NOTE + note
        made_by = data["command"].split(";" + HOST_NOTE, 1)[0] + ";" + HOST_NOTE + command
        paths.append(write_calibration(Calibration(device=device, software_stack=DEFAULT_STACK, source=source,
                                                   command=made_by, constants=constants), into_package=into_package))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated sets to fit (default: all: {','.join(SETS)})")
    parser.add_argument("--into-package", action="store_true", help="write into the package's calibration folder")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--max-evals", type=int, default=None, help="bound on the fitter's evaluations")
    parser.add_argument("--leave-out-steps", type=int, default=None,
                        help="bound on each leave-out refit's trust-region steps (default: refit to convergence)")
    parser.add_argument("--no-test-case-leave-out", action="store_true",
                        help="skip leaving out each functional test case (one refit per case)")
    args = parser.parse_args()
    if args.leave_out_steps is not None and args.leave_out_steps < 1:
        parser.error(f"--leave-out-steps: {args.leave_out_steps} must be at least 1")
    start = time.perf_counter()
    runs = [run for name in args.sets.split(",") for run in SETS[name](args.data)]
    plans = measured_plans(runs)
    print(f"traced and prepared {len(plans)} runs in {time.perf_counter() - start:.0f} s")
    space = JointSpace(plans, FITTED, fixed=FIXED, scope=scope)
    fit = fit_constants(plans, FITTED, space=space, max_nfev=args.max_evals, verbose=2)
    print(f"fitted {len(space.params)} constants in {time.perf_counter() - start:.0f} s: {fit.evaluations} "
          f"evaluations and {fit.jacobians} Jacobians, {fit.predictions} plan predictions; "
          f"{'converged' if fit.converged else 'stopped at --max-evals, not converged'}\n")
    print(report(fit, plans, test_cases=not args.no_test_case_leave_out, max_steps=args.leave_out_steps))
    if not args.dry_run:
        command = ".venv/bin/python -m benchmarks.accuracy.calibrate --into-package"
        for path in write_files(fit, plans, command, args.into_package):
            print(f"wrote {path}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

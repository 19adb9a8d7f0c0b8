"""Per-run residuals of the Megatron-LM functional tests: predicted against measured, with each plan's features.

``PYTHONPATH=$PWD .venv/bin/python -m benchmarks.accuracy.ci_residuals`` estimates every run of
``megatron_ci_calibration.csv`` with the shipped calibration files (the path of ``vtrain estimate
--no-db``), prints one row per run (GPU, parallel sizes, batch, model, features, the host-free device
time, predicted and measured ms, signed error), then the mean signed error grouped by each feature.
Why: a fitted host constant on its bound says a mechanism is missing; the feature whose groups differ
most in signed error points at which one.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from benchmarks.accuracy import ci_data
from benchmarks.accuracy.a100_data import PreparedRun, add_data_argument, error_stats, prepare_runs

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.hardware.calibration import OPTIONAL_CONSTANTS, SOFTWARE_CONSTANTS, DeviceConstants, calibration_for
from vtrain_plugin.specs.training import GradReduce



def without_host(constants: DeviceConstants) -> DeviceConstants:
    """``constants`` with every host cost zero: the run were the host free (a diagnostic, outside the
    ranges a calibration may take, hence set past the range check)."""
    out = replace(constants, **{name: OPTIONAL_CONSTANTS[name] for name in SOFTWARE_CONSTANTS if name in OPTIONAL_CONSTANTS})
    for name in SOFTWARE_CONSTANTS:
        object.__setattr__(out, name, 0.0)
    return out


def _flag(argv: str, name: str) -> bool:
    return re.search(rf"(^|\s){re.escape(name)}(\s|$)", argv) is not None


def features(p: PreparedRun) -> dict[str, object]:
    """The plan's features that might carry a mechanism, by short name."""
    run, argv = p.run, p.measured.config["megatron_args"]
    par, tr, m = run.parallel, run.training, run.model
    return {
        "gpu": p.measured.config["gpu"].split("-")[0].upper(), "stack": p.prepared.stack.value.removeprefix("megatron_core_"),
        "tp": par.tensor_parallel, "pp": par.pipeline_parallel, "vp": par.virtual_pipeline, "dp": par.data_parallel,
        "cp": par.context_parallel, "ep": par.expert_parallel, "sp": par.sequence_parallel,
        "mbs": par.micro_batch_size, "n_mb": tr.num_microbatches(par.data_parallel, par.micro_batch_size),
        "seq": m.seq_length, "hidden": m.hidden_size, "layers": m.num_layers, "moe": m.num_experts or 0,
        "recompute": par.recompute.value, "fp8": tr.fp8.value if tr.fp8 else "-",
        "cuda_graph": tr.cuda_graph_impl.value, "overlap_grad": tr.grad_reduce is GradReduce.OVERLAP,
        "overlap_param": tr.overlap_param_gather, "dist_opt": tr.distributed_optimizer,
        "deterministic": tr.deterministic, "tp_overlap": tr.tp_comm_overlap,
        "grad_acc_fusion": not _flag(argv, "--no-gradient-accumulation-fusion"),
        "clip_grad": not _flag(argv, "--clip-grad 0.0"), "log_norms": tr.log_params_norm or tr.log_num_zeros_in_grad,
        "dispatcher": par.moe_token_dispatcher.value if m.num_experts else "-",
        "grouped_gemm": m.moe_grouped_gemm, "family": m.family.value}


def residuals(prepared: Sequence[PreparedRun]) -> tuple[list[dict[str, object]], np.ndarray, np.ndarray, np.ndarray]:
    """Each run's features and its predicted, device-only and measured milliseconds."""
    feats, predicted, device_only = [], [], []
    for p in prepared:
        constants = calibration_for(p.run.cluster.gpu, p.prepared.stack.value).constants
        feats.append(features(p))
        predicted.append(p.predict_ms(constants))
        device_only.append(p.predict_ms(without_host(constants)))
    measured = np.array([p.measured.measured_ms for p in prepared])
    return feats, np.array(predicted), np.array(device_only), measured


def grouped_bias(feats: Sequence[dict[str, object]], predicted: np.ndarray, measured: np.ndarray,
                 key: Callable[[dict[str, object]], object], name: str) -> list[list[str]]:
    groups: dict[object, list[int]] = {}
    for i, f in enumerate(feats):
        groups.setdefault(key(f), []).append(i)
    rows = []
    for value, idx in sorted(groups.items(), key=lambda kv: str(kv[0])):
        s = error_stats(predicted[idx], measured[idx])
        rows.append([name, str(value), str(s.count), f"{s.bias:+.1f}", f"{s.mape:.1f}"])
    return rows


def twins(prepared: Sequence[PreparedRun], predicted: np.ndarray, measured: np.ndarray) -> tuple[list[list[str]], float]:
    """Runs the model cannot tell apart (same GPU, same prediction): their measured times, and the
    MAPE of the best one number per group (its median) over every run in such a group: a floor no
    mechanism of the plan can go under for them."""
    groups: dict[tuple[str, float], list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault((p.run.cluster.gpu, round(float(predicted[i]), 1)), []).append(i)
    rows, floor = [], []
    for (gpu, pred), idx in sorted(groups.items()):
        if len(idx) < 2:
            continue
        mid = float(np.median(measured[idx]))
        floor += [abs(measured[i] - mid) / measured[i] * 100 for i in idx]
        rows.append([gpu, f"{pred:.0f}", str(len(idx)), " ".join(f"{measured[i]:.0f}" for i in sorted(idx, key=lambda i: measured[i])),
                     f"{measured[idx].max() / measured[idx].min():.2f}",
                     ", ".join(sorted({ci_data.test_case_of(prepared[i].measured.name)[:40] for i in idx}))[:150]])
    return rows, (sum(floor) / len(floor) if floor else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    args = parser.parse_args()
    prepared = prepare_runs(ci_data.read_runs(args.data))
    feats, predicted, device_only, measured = residuals(prepared)
    err = 100 * (predicted - measured) / measured
    columns = list(feats[0])
    order = np.argsort(err)
    rows = [[ci_data.test_case_of(prepared[i].measured.name)[:58], *(str(feats[i][c]) for c in columns),
             f"{device_only[i]:.0f}", f"{predicted[i]:.0f}", f"{measured[i]:.0f}", f"{err[i]:+.1f}"] for i in order]
    print("per run, by signed error (device: the prediction with every host cost zero)")
    print(render_table(rows, ["test case", *columns, "device", "pred ms", "meas ms", "err %"]))
    s = error_stats(predicted, measured)
    print(f"\nall {s.count} runs: MAPE {s.mape:.2f}%, bias {s.bias:+.2f}%\n")
    share = 1 - device_only / measured
    groups = [row for c in columns for row in grouped_bias(feats, predicted, measured, lambda f, c=c: f[c], c)]
    groups += grouped_bias(feats, predicted, measured, lambda f: "tp*pp*cp*ep>1" if f["tp"] * f["pp"] * f["cp"] * f[
        "ep"] > 1 else "none", "model parallel")
    groups += grouped_bias([{"h": ("<25%", "25-50%", "50-75%", ">75%")[min(3, int(x * 4))]} for x in np.clip(share, 0, .99)],
                           predicted, measured, lambda f: f["h"], "measured not device")
    print("mean signed error by feature")
    print(render_table(groups, ["feature", "value", "runs", "bias %", "MAPE %"]))
    rows, floor = twins(prepared, predicted, measured)
    print("\nruns the model cannot tell apart (same GPU and prediction): measured ms, max/min")
    print(render_table(rows, ["gpu", "pred ms", "runs", "measured ms", "max/min", "test cases"]))
    print(f"{sum(int(r[2]) for r in rows)} runs in such groups; MAPE of each group's median against its runs: {floor:.1f}%")


if __name__ == "__main__":
    main()

"""Per-run residuals of the Megatron-LM functional tests: predicted against measured, with each plan's features.

``PYTHONPATH=$PWD .venv/bin/python -m benchmarks.accuracy.ci_residuals`` estimates every run of
``megatron_ci_calibration.csv`` with the shipped calibration files (the path of ``vtrain estimate
--no-db``), prints one row per run (GPU, parallel sizes, batch, model, features, the host-free device
time, predicted and measured ms, signed error), then the mean signed error grouped by each feature,
the runs the model cannot tell apart, each test case's A100 / H100 time ratio measured and predicted,
and the ceiling of any per-feature term on the TransformerEngine runs (:func:`feature_ceiling`).
Why: a fitted host constant on its bound says a mechanism is missing; the feature whose groups differ
most in signed error points at which one, and the ceiling says whether any mechanism the arguments
can tell could reach the goal at all.
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


def _int_arg(argv: str, name: str) -> int | None:
    found = re.search(rf"(^|\s){re.escape(name)}\s+(\d+)", argv)
    return int(found.group(2)) if found else None


def features(p: PreparedRun, env: str = "") -> dict[str, object]:
    """The plan's features that might carry a mechanism, by short name; ``env`` (the test's
    environment variables, no input of the estimate) and a checkpoint saved inside the measured
    run (``--save-interval`` at most ``--train-iters``) are diagnostics."""
    run, argv = p.run, p.measured.config["megatron_args"]
    save, iters = _int_arg(argv, "--save-interval"), _int_arg(argv, "--train-iters")
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
        "grouped_gemm": m.moe_grouped_gemm, "family": m.family.value,
        "save_in_run": save is not None and iters is not None and save <= iters,
        "env_nvte_deterministic": "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in env}


def residuals(prepared: Sequence[PreparedRun], env: dict[str, str] | None = None
              ) -> tuple[list[dict[str, object]], np.ndarray, np.ndarray, np.ndarray]:
    """Each run's features and its predicted, device-only and measured milliseconds."""
    feats, predicted, device_only = [], [], []
    for p in prepared:
        constants = calibration_for(p.run.cluster.gpu, p.prepared.stack.value).constants
        feats.append(features(p, (env or {}).get(p.measured.name, "")))
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


def scaled(constants: DeviceConstants, name: str, factor: float) -> DeviceConstants:
    """``constants`` with ``name`` times ``factor`` (a diagnostic step, set past the range check)."""
    out = replace(constants)
    object.__setattr__(out, name, getattr(constants, name) * factor)
    return out


STEP = 1.2  # the host constant's step for its share: 20% up


def host_shares(prepared: Sequence[PreparedRun], predicted: np.ndarray) -> np.ndarray:
    """Per run (rows) and host constant of :data:`SOFTWARE_CONSTANTS` (columns), the constant's
    share of the prediction: d log(predicted) / d log(constant), by a :data:`STEP` step."""
    out = np.zeros((len(prepared), len(SOFTWARE_CONSTANTS)))
    for i, p in enumerate(prepared):
        constants = calibration_for(p.run.cluster.gpu, p.prepared.stack.value).constants
        for j, name in enumerate(SOFTWARE_CONSTANTS):
            out[i, j] = (p.predict_ms(scaled(constants, name, STEP)) - predicted[i]) / ((STEP - 1) * predicted[i])
    return out


def _mape_of_log(residual: np.ndarray) -> float:
    """MAPE of predictions whose log(measured / predicted) is ``residual``."""
    return float(np.mean(np.abs(np.exp(-residual) - 1)) * 100)


RIDGE = (0.1, 1.0, 10.0)  # penalties on the per-feature-value factors


def feature_ceiling(feats: Sequence[dict[str, object]], shares: np.ndarray, predicted: np.ndarray,
                    measured: np.ndarray, cases: Sequence[str]) -> list[list[str]]:
    """How far a correction the model's inputs can tell could bring these runs: log(measured /
    predicted) fitted by least squares on each host constant's share (every host constant free, no
    range), then also on one free factor per value of every feature (ridge, each penalty of
    :data:`RIDGE` on the factors), each in calibration and leaving each test case out (one row per
    model: label, free terms, calibration MAPE %, leave-one-test-case-out MAPE %). Any mechanism
    that is a function of these features and host counts fits no better than the second in
    calibration; its leave-out figure is what generalises."""
    y = np.log(measured / predicted)
    dummies = []
    for name in feats[0]:
        values = sorted({str(f[name]) for f in feats})
        dummies += [[float(str(f[name]) == v) for f in feats] for v in values[1:]]
    factors = np.array(dummies, float).T.reshape(len(feats), -1)
    cases = np.array(cases)
    rows = []
    for label, x, penalty in [("host constants free", shares, 0.0),
                              *((f"host constants and every feature value free, ridge {lam:g}",
                                 np.c_[shares, factors], lam) for lam in RIDGE)]:
        ridge = np.diag([0.0] * shares.shape[1] + [penalty] * (x.shape[1] - shares.shape[1])) + 1e-9 * np.eye(x.shape[1])

        def solve(keep: np.ndarray) -> np.ndarray:
            return np.linalg.solve(x[keep].T @ x[keep] + ridge, x[keep].T @ y[keep])

        calibrated = y - x @ solve(np.ones(len(y), bool))
        left_out = np.empty_like(y)
        for case in dict.fromkeys(cases):
            out = cases == case
            left_out[out] = y[out] - x[out] @ solve(~out)
        rows.append([label, str(x.shape[1]), f"{_mape_of_log(calibrated):.2f}", f"{_mape_of_log(left_out):.2f}"])
    return rows


def gpu_ratios(feats: Sequence[dict[str, object]], cases: Sequence[str], predicted: np.ndarray,
               measured: np.ndarray) -> tuple[list[list[str]], float]:
    """Each test case run on both GPUs: its A100 / H100 time ratio measured and predicted (rows by
    measured ratio), and the MAPE of the predicted ratios: the same arguments on two GPUs, so what
    the model gets wrong here no term of the arguments can put right."""
    by_case: dict[str, dict[object, int]] = {}
    for i, case in enumerate(cases):
        by_case.setdefault(case, {})[feats[i]["gpu"]] = i
    rows, errors = [], []
    for case, at in by_case.items():
        if {"A100", "H100"} <= at.keys():
            a, h = at["A100"], at["H100"]
            ratio, model = measured[a] / measured[h], predicted[a] / predicted[h]
            errors.append(abs(model - ratio) / ratio * 100)
            rows.append([case[:58], str(feats[a]["stack"]), str(feats[a]["deterministic"]), f"{ratio:.2f}",
                         f"{model:.2f}", f"{100 * (model - ratio) / ratio:+.1f}"])
    rows.sort(key=lambda r: float(r[3]))
    return rows, float(np.mean(errors)) if errors else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(parser)
    args = parser.parse_args()
    prepared = prepare_runs(ci_data.read_runs(args.data))
    feats, predicted, device_only, measured = residuals(prepared, ci_data.read_env(args.data))
    cases = [ci_data.test_case_of(p.measured.name) for p in prepared]
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
    rows, ratio_mape = gpu_ratios(feats, cases, predicted, measured)
    print("\ntest cases on both GPUs: A100 / H100 time ratio, measured and predicted")
    print(render_table(rows, ["test case", "stack", "deterministic", "measured", "predicted", "err %"]))
    print(f"{len(rows)} test cases; MAPE of the predicted ratio: {ratio_mape:.1f}%")
    te = [i for i, f in enumerate(feats) if f["stack"] == "te"]
    shares = host_shares([prepared[i] for i in te], predicted[te])
    print(f"\nceiling of a correction by the model's inputs, the {len(te)} TransformerEngine runs "
          f"(log(measured / predicted) by least squares; host shares by a {STEP - 1:.0%} step)")
    told = [{k: v for k, v in feats[i].items() if not k.startswith("env_")} for i in te]  # the estimate's inputs
    print(render_table(feature_ceiling(told, shares, predicted[te], measured[te], [cases[i] for i in te]),
                       ["free terms", "terms", "calibration MAPE %", "leave-one-test-case-out MAPE %"]))


if __name__ == "__main__":
    main()

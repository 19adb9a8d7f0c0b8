"""The analytical estimate of the real one-GPU steps measured on lent Hopper cards, row by row (not a pass/fail test).

    .venv/bin/python -m benchmarks.accuracy.eager_steps [--fit-hbm]

The rows are ``benchmarks/results/h100_validation.csv`` and ``h200_validation.csv``: plans trained
for real with megatron-core's local spec in eager PyTorch (``megatron_adapters.real_model.train``),
each estimated again as ``benchmarks/device/h100_validation.py`` does (the plan's one-device run on
that GPU, the ``local_spec`` stack, no profile database: the analytical model alone). Prints each
row's error and, per GPU, MAPE, bias and the largest error. ``--fit-hbm`` also prints, per GPU, the
``hbm_efficiency`` that fits its rows best (least squares on the log error, every other constant as
shipped) and each row's error when that one constant is fitted without it (leave one out): the one
device constant of the eager stack that is set from these rows (see ``docs/accuracy.md``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from benchmarks.device.h100_validation import GROUND_TRUTH_CSVS, on_lent_gpu
from vtrain_plugin.cli.render import render_table

HBM_BOUNDS = (0.5, 0.95)  # the documented range of hbm_efficiency


@dataclass(frozen=True, slots=True)
class Row:
    gpu: str  # the device preset of the card it was measured on
    plan: str  # a name of benchmarks.device.h100_validation.PLANS
    measured_ms: float


def rows() -> list[Row]:
    import csv

    return [Row(gpu=gpu, plan=r["plan"], measured_ms=float(r["measured_ms"]))
            for gpu, path in GROUND_TRUTH_CSVS.items() for r in csv.DictReader(path.open())]


@lru_cache(maxsize=None)
def _prepared(gpu: str, plan: str):
    """The row's one-device run on ``gpu`` and its graph prepared for the run's stack."""
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.cost.prepare import prepare_run
    from vtrain_plugin.estimate import run_stack

    single = on_lent_gpu(plan, gpu)
    graph = trace(single.model, single.parallel)
    stack = run_stack(graph, single.cluster, single.training)
    return single, stack, prepare_run(graph, stack, single.training)


def analytic_ms(row: Row, **constants: float) -> float:
    """The row's analytical iteration time, with ``constants`` replacing the shipped ones."""
    from vtrain_plugin.estimate import predict
    from vtrain_plugin.hardware.calibration import calibration_for

    single, stack, prepared = _prepared(row.gpu, row.plan)
    shipped = calibration_for(row.gpu, stack).constants
    _, result = predict(prepared, cluster=single.cluster, training=single.training,
                        constants=replace(shipped, **constants))
    return result.iteration_ns / 1e6


def fit_hbm(selected: list[Row]) -> float:
    """The ``hbm_efficiency`` (within its range) that minimises the squared log errors of ``selected``."""
    from scipy.optimize import minimize_scalar

    def loss(efficiency: float) -> float:
        return sum(math.log(analytic_ms(r, hbm_efficiency=efficiency) / r.measured_ms) ** 2 for r in selected)

    return float(minimize_scalar(loss, bounds=HBM_BOUNDS, method="bounded", options={"xatol": 1e-4}).x)


def _summary(errors: dict[str, list[float]]) -> list[list[str]]:
    out = []
    for gpu, values in errors.items():
        e = np.array(values)
        out.append([gpu, str(len(e)), f"{np.abs(e).mean():.1f}", f"{e.mean():+.1f}", f"{np.abs(e).max():.1f}"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit-hbm", action="store_true", help="fit hbm_efficiency per GPU, and leave one row out")
    args = parser.parse_args(argv)
    data = rows()
    table, errors, held_out = [], {}, {}
    fitted = {gpu: fit_hbm([r for r in data if r.gpu == gpu]) for gpu in GROUND_TRUTH_CSVS} if args.fit_hbm else {}
    for r in data:
        ms = analytic_ms(r)
        error = 100 * (ms / r.measured_ms - 1)
        errors.setdefault(r.gpu, []).append(error)
        line = [r.gpu, r.plan, f"{r.measured_ms:,.1f}", f"{ms:,.1f}", f"{error:+.1f}"]
        if args.fit_hbm:
            others = fit_hbm([o for o in data if o.gpu == r.gpu and o is not r])
            loo = 100 * (analytic_ms(r, hbm_efficiency=others) / r.measured_ms - 1)
            held_out.setdefault(r.gpu, []).append(loo)
            line += [f"{others:.3f}", f"{loo:+.1f}"]
        table.append(line)
    header = ["gpu", "plan", "measured ms", "analytic ms", "err %"]
    if args.fit_hbm:
        header += ["hbm fitted without it", "err % (left out)"]
    print(render_table(table, header))
    print("\nas shipped\n" + render_table(_summary(errors), ["gpu", "rows", "MAPE %", "bias %", "max |err| %"]))
    if args.fit_hbm:
        print("\nhbm_efficiency fitted per GPU: " + ", ".join(f"{g} {v:.3f}" for g, v in fitted.items()))
        print("leave one row out\n" + render_table(_summary(held_out), ["gpu", "rows", "MAPE %", "bias %",
                                                                         "max |err| %"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

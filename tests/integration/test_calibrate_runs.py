"""vtrain calibrate: recovers known constants from logs of vtrain's own estimates with noise, stays
inside the documented ranges, writes a readable user calibration, refuses unidentifiable fits."""

import json
from dataclasses import replace

import numpy as np
import pytest

import vtrain_plugin as vtrain
from tests.support.training_logs import Logged, megatron_log, write_lines
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured import PlanRuns, fit_calibration
from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, calibration_for, user_calibration_dir, write_calibration

DEVICE, STACK = "a100-sxm4-80gb", "megatron_deepspeed_2023"
TRUE = {"gemm_efficiency": 0.72, "network_efficiency": 0.82, "host_overhead_ns": 8000.0}
# Host-bound, compute-bound on one node, and two across four nodes (gradients over the network).
SHAPES = {"small": (512, 8, 1, 1, 64, 512), "wide": (4096, 32, 1, 8, 16, 2048), "dp32": (2048, 16, 4, 1, 32, 1024),
          "wide32": (4096, 32, 4, 8, 32, 2048)}


def _script(folder, name, hidden, heads, nodes, tp, batch, seq):
    path = folder / f"{name}.sh"
    path.write_text(f"torchrun --nnodes {nodes} --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size "
                    f"{hidden} --num-attention-heads {heads} --seq-length {seq} --max-position-embeddings {seq} "
                    f"--micro-batch-size 1 --global-batch-size {batch} --tensor-model-parallel-size {tp} --fp16 "
                    f"--vocab-size 32000 --use-legacy-models\n")  # the legacy Megatron GPT: STACK
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch scripts and logs whose times are vtrain's estimates under TRUE, with 0.5% seeded noise per
    logged interval (the log prints them to 0.1 ms, as Megatron-LM does)."""
    folder = tmp_path_factory.mktemp("runs")
    shipped = calibration_for(DEVICE, STACK)
    truth = replace(shipped.constants, **TRUE, backward_host_overhead_ns=TRUE["host_overhead_ns"])
    write_calibration(replace(shipped, constants=truth, source="known constants", command="test"))
    rng = np.random.default_rng(21)
    out = {}
    try:
        for name, shape in SHAPES.items():
            script = _script(folder, name, *shape)
            run = vtrain.load_megatron_script(script)
            ms = vtrain.estimate(run).iteration_time_ms
            entries = [Logged(i, ms * float(np.exp(0.005 * rng.standard_normal())), batch=run.training.global_batch_size)
                       for i in range(10, 410, 10)]
            out[name] = (script, run, write_lines(folder / f"{name}.log", megatron_log(entries, world_size=run.parallel.world_size)))
    finally:
        (user_calibration_dir() / DEVICE / f"{STACK}.json").unlink()
    return out


def test_calibrate_recovers_known_constants_within_ranges(runs):
    fit = fit_calibration([PlanRuns(label=name, run=run, logs=(log,)) for name, (_, run, log) in runs.items()])
    for name, value in TRUE.items():
        fitted = getattr(fit.after, name)
        assert abs(fitted / value - 1) < 0.02, (name, fitted, value)
        assert fit.ranges[name][0] <= fitted <= fit.ranges[name][1] <= CONSTANT_RANGES[name][1]
    assert fit.after.backward_host_overhead_ns == fit.after.host_overhead_ns
    assert fit.error_after_pct < 0.5 < fit.error_before_pct
    # left out where the others still identify the constants: not the one host-bound run (without it
    # the three others, all host-informed under the shipped host costs, cannot separate them)
    assert fit.leave_one_out_error_pct is not None
    assert [r.plan for r in fit.runs if r.leave_one_out_ms is None] == ["small"]
    assert [r.informs for r in fit.runs][0] == ("host_overhead_ns",)


def test_calibrate_cli_writes_a_calibration_that_estimates_read(runs, run_cli, tmp_path):
    scripts = [str(runs[name][0]) for name in SHAPES]
    logs = [str(runs[name][2]) for name in SHAPES]
    env = {"VTRAIN_CALIBRATION_DIR": str(tmp_path / "calibrations")}
    proc = run_cli("calibrate", "--from-runs", *logs, "--plan", *scripts, "--format", "json", env=env, check=True,
                   fresh=True)  # vtrain calibrate in a plain subprocess
    document = json.loads(proc.stdout)
    written = tmp_path / "calibrations" / DEVICE / f"{STACK}.json"
    assert document["written"] == str(written)
    data = json.loads(written.read_text())
    assert data["provenance"]["fitted"].keys() == TRUE.keys()
    assert [r["logs"] for r in data["provenance"]["runs"]] == [[log] for log in logs]
    assert data["command"].startswith("vtrain calibrate --from-runs")
    compare = json.loads(run_cli("compare", scripts[1], logs[1], "--format", "json", env=env, check=True).stdout)
    assert abs(compare["iteration_time_ms_error_pct"]) < 0.5


def test_calibrate_refuses_what_the_runs_cannot_identify(runs, run_cli):
    small, wide = runs["small"], runs["wide"]
    with pytest.raises(ConfigError, match=r"network_efficiency is informed by no run \(small informs host_overhead_ns; "
                                          r"wide informs gemm_efficiency, host_overhead_ns"):
        fit_calibration([PlanRuns(label="small", run=small[1], logs=(small[2],)),
                         PlanRuns(label="wide", run=wide[1], logs=(wide[2],)),
                         PlanRuns(label="wide again", run=wide[1], logs=(wide[2],))])
    proc = run_cli("calibrate", "--from-runs", str(small[2]), str(wide[2]), "--plan", str(small[0]), str(wide[0]))
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("vtrain: note: ")]  # default GPU
    assert proc.returncode == 2 and len(errors) == 1
    assert errors[0].startswith("vtrain: error: refusing to fit gemm_efficiency, network_efficiency, "
                                  "host_overhead_ns: 2 runs cannot identify 3 constants")
    bad = run_cli("calibrate", "--from-runs", str(small[2]), "--plan", str(small[0]), "--fit", "kernel_speed")
    assert bad.returncode == 2 and "--fit: 'kernel_speed' is not a constant calibrate fits" in bad.stderr


JOINT_TRUTH = {"a100-sxm4-80gb": 0.70, "h100-sxm": 0.66}
JOINT_NAMES = ("gemm_efficiency", "iteration_overhead_ns")


@pytest.fixture(scope="module")
def joint_plans():
    """A host-bound and a compute-bound plan on each of two GPUs of one stack, with the times predicted
    under JOINT_TRUTH's GEMM efficiencies and a 3 ms iteration cost."""
    from vtrain_plugin.measured.calibrate import measured_plan
    from vtrain_plugin.runs import run_config_from_megatron_args
    from vtrain_plugin.hardware.clusters import cluster_for_gpu

    plans = []
    for hidden, heads in ((512, 8), (4096, 32)):  # host-bound, compute-bound
        args = (f"--num-layers 2 --hidden-size {hidden} --num-attention-heads {heads} --seq-length 2048 "
                f"--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --bf16 --vocab-size 32000 "
                f"--transformer-impl transformer_engine")
        for gpu in JOINT_TRUTH:
            run = run_config_from_megatron_args(args, gpus=8, cluster=cluster_for_gpu(gpu))
            plan = measured_plan(f"{hidden} on {gpu}", run, 1.0)
            known = replace(plan.base, gemm_efficiency=JOINT_TRUTH[gpu], iteration_overhead_ns=3e6)
            plans.append(replace(plan, measured_ms=plan.predict_ms(known)))
    return plans


def test_a_joint_fit_shares_host_costs_by_stack_and_device_constants_by_gpu(joint_plans):
    """fit_constants over two GPUs of one stack: one iteration cost for the stack, one GEMM efficiency
    per GPU, recovered from times predicted with them."""
    from vtrain_plugin.measured.calibrate import JointSpace, fit_constants

    space = JointSpace(joint_plans, JOINT_NAMES)
    assert space.params == (("gemm_efficiency", "a100-sxm4-80gb"), ("iteration_overhead_ns", "megatron_core_te"),
                            ("gemm_efficiency", "h100-sxm"))
    fit = fit_constants(joint_plans, JOINT_NAMES, space=space)
    for gpu, value in JOINT_TRUTH.items():
        assert fit.value(("gemm_efficiency", gpu)) == pytest.approx(value, rel=2e-3)
    assert fit.value(("iteration_overhead_ns", "megatron_core_te")) == pytest.approx(3e6, rel=2e-3)
    assert np.abs(fit.residuals).max() < 1e-4 and fit.on_bound() == [] and fit.converged
    # A GPU's GEMM efficiency moves the times of that GPU's two plans only: its finite differences
    # predict 2 plans, the stack's iteration cost 4 (8 a Jacobian, not 3 x 4).
    assert fit.jacobians > 0 and fit.predictions <= 4 * fit.evaluations + 8 * fit.jacobians


def test_leave_out_is_a_real_refit_not_a_linear_step(joint_plans):
    """Measured times off the model by up to 30%: each leave-out (the user's leave-one-out and the
    benchmark's by group) is exactly fit_constants on the rest from the full fit, and one Gauss-Newton
    step from the full fit's Jacobian lands elsewhere."""
    from scipy.optimize import lsq_linear

    from benchmarks.accuracy.calibrate import leave_out
    from vtrain_plugin.measured.calibrate import JointSpace, fit_constants, leave_out_refits

    plans = [replace(p, measured_ms=p.measured_ms * f) for p, f in zip(joint_plans, (1.3, 0.9, 1.0, 1.1))]
    space = JointSpace(plans, JOINT_NAMES)
    fit = fit_constants(plans, JOINT_NAMES, space=space)
    groups = [[0], [1, 3], [2], [0]]
    refits = leave_out_refits(fit, plans, groups)
    assert refits[0] is refits[3]  # a group given twice is refitted once
    linear_moves = []
    for group, refit in zip(groups, refits):
        rest = [p for i, p in enumerate(plans) if i not in group]
        alone = fit_constants(rest, JOINT_NAMES, start=fit.unit, space=space)
        assert np.array_equal(refit.unit, alone.unit) and refit.converged
        keep = np.array([i not in group for i in range(len(plans))])
        w = fit.weights[keep][:, None]
        step = lsq_linear(w * fit.jacobian[keep], -(w[:, 0] * (fit.residuals[keep] - fit.jacobian[keep] @ fit.unit)),
                          bounds=(0.0, 1.0)).x
        linear_moves.append(max(abs(plans[i].predict_ms(space.constants(plans[i], step))
                                    / plans[i].predict_ms(refit.constants(plans[i])) - 1) for i in group))
    assert max(linear_moves) > 0.01, linear_moves
    by = leave_out(fit, plans, {"gpu": lambda i: plans[i].device, "second": lambda i: None if i % 2 else i},
                   max_steps=None)
    for i, plan in enumerate(plans):
        rest = [p for p in plans if p.device != plan.device]
        assert by["gpu"][i] == plan.predict_ms(fit_constants(rest, JOINT_NAMES, start=fit.unit, space=space)
                                               .constants(plan))
    assert by["second"][1] == plans[1].predict_ms(fit.constants(plans[1]))  # no key: the full fit's
    assert by["second"][0] == plans[0].predict_ms(refits[0].constants(plans[0]))
    # Bounded to one trust-region step: the same step as the fit's own first, and no Jacobian after it.
    one, = leave_out_refits(fit, plans, [[1, 3]], max_steps=1)
    rest = [plans[0], plans[2]]
    alone = fit_constants(rest, JOINT_NAMES, start=fit.unit, space=space, max_steps=1)
    assert np.array_equal(one.unit, alone.unit) and one.jacobians == alone.jacobians == 1
    assert np.sum((one.weights * one.residuals) ** 2) < np.sum((one.weights * fit.residuals[[0, 2]]) ** 2)

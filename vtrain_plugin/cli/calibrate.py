"""``vtrain calibrate --from-runs RUN... --plan PLAN...``: fit the cluster constants the user's runs
identify and write them as a user calibration file."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import emit
from vtrain_plugin.cli.inputs import INPUT_HELP, MEGATRON_ARGS_LABEL, add_input_options, run_inputs
from vtrain_plugin.cli.runs_render import calibration_table
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.measured.calibrate import DEFAULT_FIT, PlanRuns, fit_calibration
from vtrain_plugin.measured.compare_run import DEFAULT_WARMUP_ITERATIONS
from vtrain_plugin.hardware.calibration import CONSTANT_RANGES, write_calibration


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-runs", nargs="+", required=True, metavar="RUN",
                   help="Megatron-LM or NeMo training logs, or Megatron-LM TensorBoard folders")
    p.add_argument("--plan", nargs="+", metavar="PLAN",
                   help=f"the plan of each RUN, in order ({INPUT_HELP}), or one plan for every RUN; the runs of "
                        f"one plan are pooled; or --megatron-args, the plan of every RUN")
    p.add_argument("--fit", default=",".join(DEFAULT_FIT), metavar="LIST",
                   help=f"constants to fit (default {','.join(DEFAULT_FIT)}; any of "
                        f"{', '.join(CONSTANT_RANGES)} but backward_host_overhead_ns, which follows host_overhead_ns)")
    p.add_argument("--warmup-iterations", type=int, default=DEFAULT_WARMUP_ITERATIONS, metavar="N",
                   help=f"as in vtrain compare (default {DEFAULT_WARMUP_ITERATIONS})")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write no file")
    p.add_argument("--format", choices=("table", "json"), default="table")
    add_input_options(p)


def run(args: argparse.Namespace) -> int:
    plans = _plan_runs(args)
    result = fit_calibration(plans, fit=[name.strip() for name in args.fit.split(",") if name.strip()],
                             warmup_iterations=args.warmup_iterations)
    path = None
    if not args.dry_run:
        command = "vtrain " + " ".join(shlex.quote(word) for word in sys.argv[1:])
        path = write_calibration(result.calibration(command))
    if args.format == "json":
        emit(json.dumps({**result.to_dict(), "written": None if path is None else str(path)}, indent=1,
                        allow_nan=False), None)
    else:
        emit(calibration_table(result) + ("\n(dry run: nothing written)" if path is None else f"\nwrote {path}"), None)
    return 0


def _plan_runs(args: argparse.Namespace) -> list[PlanRuns]:
    """The runs grouped by plan: ``--plan`` paired with ``--from-runs`` in order, or one plan for all."""
    logs = args.from_runs
    if (args.plan is None) == (args.megatron_args is None):
        raise ConfigError("give the plan of the runs: --plan PLAN... or --megatron-args, one of them")
    plans = args.plan or [MEGATRON_ARGS_LABEL]
    if len(plans) not in (1, len(logs)):
        raise ConfigError(f"--plan: give one plan per --from-runs log (paired in order) or one plan for all of "
                          f"them: got {len(logs)} logs and {len(plans)} plans")
    if len(plans) == 1:
        plans = plans * len(logs)
    grouped: dict[str, list[str]] = {}
    for plan, log in zip(plans, logs):
        grouped.setdefault(plan, []).append(log)
    loaded = dict(run_inputs(args, [plan for plan in grouped if plan != MEGATRON_ARGS_LABEL]))
    return [PlanRuns(label=plan, run=loaded[plan](), logs=tuple(group)) for plan, group in grouped.items()]


COMMANDS = (Command(name="calibrate", add_arguments=add_arguments, run=run, traces=True,
                    help="fit network efficiency, GEMM efficiency and host cost to your own runs"),)

"""``vtrain compare PLAN RUN... [PLAN RUN...]``: each plan's estimate against the logs of its runs.

A positional argument ending in an input suffix (``.yaml``, ``.yml``, ``.json``, ``.sh``, ``.bash``:
any input of :mod:`vtrain_plugin.cli.inputs`) starts a plan; the logs (Megatron-LM or NeMo text logs, TensorBoard folders) after it are its runs,
pooled. With ``--megatron-args`` the logs before the first plan file are the runs of that plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import db_option, emit, profile_db
from vtrain_plugin.cli.inputs import INPUT_HELP, INPUT_SUFFIXES, MEGATRON_ARGS_LABEL, add_input_options, run_inputs
from vtrain_plugin.cli.runs_render import comparison_table, comparisons_summary
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.estimate import estimate
from vtrain_plugin.measured.compare_run import DEFAULT_SLOW_FACTOR, DEFAULT_WARMUP_ITERATIONS, RunComparison, compare_run
from vtrain_plugin.measured.plot import plot_comparisons
from vtrain_plugin.specs.run import RunConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="PLAN RUN",
                   help=f"a plan ({INPUT_HELP}) followed by the logs of its runs "
                        "(Megatron-LM or NeMo training logs, Megatron-LM TensorBoard folders), pooled; more plans, "
                        "each with its runs, give a table")
    add_input_options(p)
    p.add_argument("--warmup-iterations", type=int, default=DEFAULT_WARMUP_ITERATIONS, metavar="N",
                   help=f"leave out the logged intervals that begin in the first N iterations of each start of a "
                        f"job (default {DEFAULT_WARMUP_ITERATIONS})")
    p.add_argument("--slow-factor", type=float, default=DEFAULT_SLOW_FACTOR, metavar="X",
                   help=f"flag intervals slower than X times the median (default {DEFAULT_SLOW_FACTOR})")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the measured intervals against the predicted time")
    db_option(p, can_disable=True)


def run(args: argparse.Namespace) -> int:
    results: list[tuple[str, RunComparison]] = []
    for label, load, logs in plan_groups(args):
        run_config = load()
        comparison = compare_run(estimate(run_config, profile_db=profile_db(args)), logs,
                                 warmup_iterations=args.warmup_iterations, slow_factor=args.slow_factor)
        results.append((label, comparison))
    if args.plot:
        plot_comparisons(results, args.plot)
    if args.format == "json":
        documents = [{"plan": label, **c.to_dict()} for label, c in results]
        emit(json.dumps(documents[0] if len(documents) == 1 else documents, indent=1, allow_nan=False), None)
    elif args.format == "csv":
        import pandas as pd

        frames = [c.to_frame().assign(plan=label)[["plan", "quantity", "predicted", "measured", "error_pct"]]
                  for label, c in results]
        sys.stdout.write(pd.concat(frames).to_csv(index=False))
    elif len(results) == 1:
        emit(comparison_table(*results[0]), None)
    else:
        emit(comparisons_summary(results), None)
    return 0


def plan_groups(args: argparse.Namespace) -> list[tuple[str, Callable[[], RunConfig], list[str]]]:
    """``(plan label, load, logs)`` per plan of the command line (see the module doc)."""
    groups: list[tuple[str, list[str]]] = [(MEGATRON_ARGS_LABEL, [])] if args.megatron_args is not None else []
    for item in args.inputs:
        if _is_plan(item):
            groups.append((item, []))
        elif not groups:
            raise ConfigError(f"{item}: a run log before any plan: give the plan first (a file ending in "
                              f"{', '.join(INPUT_SUFFIXES)}) or --megatron-args")
        else:
            groups[-1][1].append(item)
    for label, logs in groups:
        if not logs:
            raise ConfigError(f"{label}: a plan without a run log after it")
    plans = dict(_plan_inputs(args))
    return [(label, plans[label], logs) for label, logs in groups]


def _is_plan(item: str) -> bool:
    return Path(item).suffix.lower() in INPUT_SUFFIXES and not Path(item).is_dir()


def _plan_inputs(args: argparse.Namespace) -> list[tuple[str, Callable[[], RunConfig]]]:
    return run_inputs(args, [item for item in args.inputs if _is_plan(item)])


COMMANDS = (Command(name="compare", add_arguments=add_arguments, run=run, traces=True,
                    help="compare a plan's estimate with the training logs of its runs"),)

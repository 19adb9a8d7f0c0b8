"""``vtrain search INPUT``: every valid plan of a model within a GPU budget, estimated and ranked.

The input is any of :mod:`vtrain_plugin.cli.inputs`; its model is searched, its training and cluster
are the defaults, its parallel plan is not read."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Literal

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.runs import ModelFile, load_model_source, load_run_config, model_file_of
from vtrain_plugin.cli.common import db_option, emit, profile_db, reliability_options, with_reliability
from vtrain_plugin.cli.render import search_csv, search_jsonl, search_table
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cli.inputs import INPUT_HELP, add_input_options, hardware, run_inputs, script_env
from vtrain_plugin.planning.backends import BACKENDS
from vtrain_plugin.planning.plot import plot_search
from vtrain_plugin.planning.search import OBJECTIVES, evaluate_baseline, search
from vtrain_plugin.planning.space import AXES, Candidate, GpuBudget, SearchSpace
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import TrainingSpec

FORMATS = ("table", "csv", "jsonl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file", metavar="INPUT", nargs="?",
                   help=f"{INPUT_HELP}: its model; its cluster and training are defaults (or --megatron-args)")
    add_input_options(p, gpu_count=False)
    p.add_argument("--global-batch", metavar="N",
                   help="sequences per iteration (default: the file's training.global_batch_size)")
    p.add_argument("--gpus", metavar="BUDGET",
                   help="GPUs a plan may use: a count (exactly that many: 3360), a range (1024:4096; 1:3360 for at "
                        "most 3360) or a list (2240,2800,3360)")
    for axis in AXES:
        p.add_argument(f"--{axis.flag.replace('_', '-')}", dest=axis.name, metavar="LIST",
                       help=f"{axis.label}; comma-separated (default: {axis.default_label})")
    p.add_argument("--max-tp", metavar="N", help="largest tensor-parallel size tried (default: GPUs per node, or the largest --tp given)")
    p.add_argument("--objective", default="time",
                   help="rank the plans that fit by time, days (to train --tokens) or cost (default time); with "
                        "--tokens, time and days rank by the days to train and cost by the cost to train, both "
                        "expected with failures unless --failures off")
    p.add_argument("--top", default="10", metavar="K", help="plans in the table (default 10)")
    p.add_argument("--best-first", action="store_true",
                   help="cost only the plans whose proven time floor can still reach the --top K: the same first "
                        "K rows as the whole search, fewer plans costed (the table and front hold those alone)")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table: the top K and a summary; csv, jsonl: every evaluated plan")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.add_argument("--plot", metavar="FILE.png", help="draw time against cost, the Pareto front and the baseline")
    p.add_argument("--baseline", metavar="CONFIG", help="plan file or vTrain config of a plan to compare with")
    p.add_argument("--workers", metavar="N", help="worker processes or Ray tasks at once (default: CPU count)")
    p.add_argument("--backend", default="local", help=f"{' | '.join(BACKENDS)} (default local)")
    p.add_argument("--tokens", metavar="N", help="also the days and cost to train on N tokens, e.g. 270e9")
    reliability_options(p)
    db_option(p, can_disable=True)


def run(args: argparse.Namespace) -> int:
    if args.gpus is None:
        raise ConfigError("--gpus is required: a count (3360), a range (1024:4096) or a list (2240,2800,3360)")
    budget = GpuBudget.parse(args.gpus, where="--gpus")
    source = _source(args, budget)
    if args.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}; got {args.objective!r}")
    if args.backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}; got {args.backend!r}")
    cluster = source.cluster
    global_batch = _global_batch(args, source)
    tokens = _number("--tokens", args.tokens, float) if args.tokens is not None else None
    space = space_from_args(args)
    training = source.training or TrainingSpec(global_batch_size=global_batch)
    training = replace(training, reliability=with_reliability(args, training.reliability))
    baseline = (_baseline(args.baseline, source, cluster, global_batch, tokens, training.reliability, profile_db(args))
                if args.baseline else None)
    result = search(source.model, cluster=cluster, global_batch_size=global_batch,
                    gpus=budget, space=space, training=training,
                    objective=args.objective, top_k=_number("--top", args.top, int),
                    workers=_number("--workers", args.workers, int) if args.workers is not None else None,
                    backend=args.backend, progress=sys.stderr.isatty(), tokens=tokens,
                    profile_db=profile_db(args), exhaustive=not args.best_first)
    if args.format == "csv":
        emit(search_csv(result.table), args.output)
    elif args.format == "jsonl":
        emit(search_jsonl(result.table), args.output)
    else:
        emit(search_table(result, baseline=baseline), args.output)
    if args.plot:
        plot_search(result, args.plot, baseline=baseline,
                    baseline_label=f"baseline {Path(args.baseline).name}" if baseline else "baseline")
    return 0


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    """The search space of the axis flags (``--tp 4,8``, ...) and ``--max-tp``."""
    return SearchSpace(
        **{axis.name: axis.values(getattr(args, axis.name).split(","), where=f"--{axis.flag.replace('_', '-')}")
           for axis in AXES if getattr(args, axis.name) is not None},
        max_tp=_number("--max-tp", args.max_tp, int) if args.max_tp is not None else None)


def _source(args: argparse.Namespace, budget: GpuBudget) -> ModelFile:
    """The model, training and cluster of the input, on the hardware options. A Megatron-LM input is
    read on the budget's GPU count when it is one count (its global batch may follow the data-parallel
    size), else on its launcher's."""
    if (args.model_file is None) == (args.megatron_args is None):
        raise ConfigError("give one input: a file or --megatron-args")
    gpus = budget.counts[0] if len(budget.counts) == 1 else None
    if args.model_file is None:
        [(_, load)] = run_inputs(args, [], gpus=gpus)
        return model_file_of(load())
    return load_model_source(args.model_file, gpus=gpus, hardware=hardware(args), env=script_env(args.env))


def _global_batch(args: argparse.Namespace, source: ModelFile) -> int:
    if args.global_batch is not None:
        return _number("--global-batch", args.global_batch, int)
    if source.training is None:
        raise ConfigError(f"--global-batch is required: {source.source} has no training section")
    return source.training.global_batch_size


def _number(flag: str, text: str, kind: type[int] | type[float]) -> int | float:
    """A positive int or float option; a one-line error naming the flag otherwise."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        noun = "a positive integer" if kind is int else "a positive number"
        raise ConfigError(f"{flag} must be {noun}, got {text!r}")
    return value


def _baseline(path: str, source: ModelFile, cluster: ClusterSpec, global_batch: int,
              tokens: float | None, reliability: ReliabilitySpec | None, db: str | Literal[False] | None) -> dict:
    """The row of the plan in ``path``, on the search's cluster with its global batch and reliability."""
    run = load_run_config(path)
    if replace(run.model, name="") != replace(source.model, name=""):
        raise ConfigError(f"--baseline {path}: its model is not the model of {source.source}")
    try:
        candidate = Candidate(parallel=run.parallel, training=replace(run.training, global_batch_size=global_batch,
                                                                      reliability=reliability))
        return evaluate_baseline(source.model, candidate, cluster, tokens, profile_db=db)
    except ConfigError as exc:
        raise ConfigError(f"--baseline {path}: {exc}") from None


COMMANDS = (Command(name="search", add_arguments=add_arguments, run=run, traces=True,
                    help="estimate every valid plan within a GPU budget and rank them"),)

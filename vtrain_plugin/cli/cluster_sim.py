"""``vtrain cluster-sim``: many training jobs on one shared cluster under scheduling policies."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import emit
from vtrain_plugin.cli.search import _number
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_for_gpu, cluster_preset_names, get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig, Granularity
from vtrain_plugin.planning.cluster.curve_cache import CurveCache, compute_curves, job_curves
from vtrain_plugin.planning.cluster.curves import CurveSpace
from vtrain_plugin.planning.cluster.failures import FailureModel
from vtrain_plugin.planning.cluster.generator import DEFAULT_MODELS, MixSpec, generate_jobs
from vtrain_plugin.planning.cluster.jobs import job_from_entry, read_jobs, write_jobs
from vtrain_plugin.planning.cluster.policies import POLICIES
from vtrain_plugin.planning.cluster.report import format_summary, report_dict, summary_table
from vtrain_plugin.planning.cluster.simulator import DEFAULT_RESTART_S, simulate
from vtrain_plugin.planning.space import AXES
from vtrain_plugin.specs.reliability import CheckpointMode, FailurePreset, ReliabilitySpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("jobs", nargs="?", metavar="JOBS", help="job file (YAML, JSON or CSV); or use --generate")
    mix = p.add_argument_group("synthetic job mix")
    mix.add_argument("--generate", metavar="N", help="simulate N synthetic jobs instead of a job file")
    mix.add_argument("--seed", default="0", metavar="S", help="seed of the synthetic mix and of the failures (default 0)")
    mix.add_argument("--slack", default="1.5:3", metavar="LOW[:HIGH]",
                     help="deadline = submit + slack x ideal time, slack uniform in LOW:HIGH (default 1.5:3)")
    mix.add_argument("--load", default="1", metavar="L", help="offered load of the arrivals (default 1)")
    mix.add_argument("--models", default=",".join(DEFAULT_MODELS), metavar="LIST",
                     help=f"model presets of the mix (default {','.join(DEFAULT_MODELS)})")
    mix.add_argument("--write-jobs", metavar="FILE", help="also write the synthetic jobs as a job file")
    cluster = p.add_argument_group("cluster")
    node = cluster.add_mutually_exclusive_group(required=True)
    node.add_argument("--gpu", help="GPU preset, on its usual node (A100, H100, H200, ...)")
    node.add_argument("--cluster", help=f"node preset ({', '.join(cluster_preset_names())})")
    cluster.add_argument("--nodes", required=True, metavar="N", help="nodes in the cluster")
    cluster.add_argument("--gpus-per-node", metavar="G", help="GPUs per node (default: the preset's)")
    cluster.add_argument("--price", metavar="USD", help="price per GPU-hour (default: the preset's)")
    cluster.add_argument("--granularity", default="node", help="allocate whole nodes or single GPUs: node | gpu")
    p.add_argument("--policy", default="all", help=f"{' | '.join(POLICIES.names())} | all (default all)")
    p.add_argument("--restart-cost", default=str(DEFAULT_RESTART_S), metavar="S",
                   help=f"seconds without progress at every start and resize (default {DEFAULT_RESTART_S:g})")
    curves = p.add_argument_group("throughput curves (vtrain's plan search at every GPU count)")
    curves.add_argument("--tp", default="auto", metavar="auto|LIST",
                        help="tensor-parallel sizes; auto: at each GPU count the smallest that fits (default)")
    curves.add_argument("--micro-batch", default="1", metavar="N", help="micro-batch size (default 1)")
    curves.add_argument("--recompute", default="full", help="activation recompute: none, selective, full (default)")
    failures = p.add_argument_group("failures (off by default)")
    failures.add_argument("--failures", default="off",
                          choices=("off", "on", *(preset.value for preset in FailurePreset)),
                          help="jobs fail at a published rate (on: large-scale, Llama 3's), lose the work since "
                               "their last checkpoint and restart in place at the restart cost; seeded by --seed")
    failures.add_argument("--checkpoint", choices=tuple(mode.value for mode in CheckpointMode), default="sync",
                          help="sync (default) or async checkpoints at each job's Daly interval")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the allocation over time (FILE.POLICY.png for several)")


def run(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    policies = POLICIES.names() if args.policy == "all" else (POLICIES.get(args.policy).name,)
    restart_s = _non_negative("--restart-cost", args.restart_cost)
    space = _curve_space(args)
    cache = CurveCache.from_environment()  # --cache-dir and --no-cache, as for the traces
    progress = sys.stderr.isatty()
    if (args.jobs is None) == (args.generate is None):
        raise ConfigError("give a job file or --generate N (not both)")
    if args.jobs is not None:
        jobs = read_jobs(args.jobs)
    else:
        mix = MixSpec(jobs=_number("--generate", args.generate, int), seed=_seed(args.seed), slack=_range(args.slack),
                      load=_number("--load", args.load, float), models=tuple(args.models.split(",")),
                      restart_s=restart_s)
        compute_curves(mix.shapes(), cluster, space, cache, progress=progress)
        rows = generate_jobs(mix, cluster, lambda model, batch: cache.curve(model, batch, cluster, space))
        if args.write_jobs:
            write_jobs(args.write_jobs, rows)
        jobs = tuple(job_from_entry(row, number=i) for i, row in enumerate(rows, start=1))
    curves = job_curves(jobs, cluster, space, cache, progress=progress)
    failures = None
    if args.failures != "off":
        preset = FailurePreset.LARGE_SCALE if args.failures == "on" else FailurePreset(args.failures)
        failures = FailureModel(reliability=ReliabilitySpec(failures=preset, checkpoint=CheckpointMode(args.checkpoint)),
                                seed=_seed(args.seed))
    results = [simulate(jobs, curves, cluster, name, restart_s=restart_s, progress=progress, failures=failures)
               for name in policies]
    if args.format == "json":
        emit(json.dumps(report_dict(results), indent=1, allow_nan=False), args.output)
    else:
        unfit = [f"  {job.name}: {curves[job.name].reason}" for job in jobs if not curves[job.name].fits]
        failing = ("" if failures is None else f", failures {failures.reliability.failures.value} "
                   f"({failures.reliability.rate_per_gpu_hour:.3g} per GPU-hour, seed {failures.seed}), "
                   f"{failures.reliability.checkpoint.value} checkpoints")
        lines = [f"{len(jobs)} jobs on {cluster.describe()}, restart cost {restart_s:g} s{failing}", "",
                 format_summary(summary_table(results))]
        if unfit:
            lines += ["", f"{len(unfit)} job(s) fit nowhere and are rejected by every policy:", *unfit[:5]]
            lines += [f"  ... and {len(unfit) - 5} more"] if len(unfit) > 5 else []
        emit("\n".join(lines), args.output)
    if args.gantt:
        from vtrain_plugin.planning.cluster.gantt import plot_gantt  # matplotlib: loaded only to draw

        for result in results:
            path = Path(args.gantt)
            plot_gantt(result, path if len(results) == 1 else path.with_suffix(f".{result.policy}{path.suffix}"))
    return 0


def _cluster(args: argparse.Namespace) -> ClusterConfig:
    spec = cluster_for_gpu(args.gpu) if args.gpu else get_cluster_preset(args.cluster)
    if args.gpus_per_node is not None:
        spec = replace(spec, gpus_per_node=_number("--gpus-per-node", args.gpus_per_node, int))
    if args.price is not None:
        spec = replace(spec, price_per_gpu_hour_usd=_non_negative("--price", args.price))
    if args.granularity not in [g.value for g in Granularity]:
        raise ConfigError(f"--granularity must be one of {', '.join(g.value for g in Granularity)}; "
                          f"got {args.granularity!r}")
    return ClusterConfig(spec=spec, nodes=_number("--nodes", args.nodes, int), granularity=args.granularity)


def _curve_space(args: argparse.Namespace) -> CurveSpace:
    axes = {axis.name: axis for axis in AXES}
    tp = None if args.tp == "auto" else axes["tensor_parallel"].values(args.tp.split(","), where="--tp")
    (recompute,) = axes["recompute"].values([args.recompute], where="--recompute")
    return CurveSpace(tensor_parallel=tp, micro_batch_size=_number("--micro-batch", args.micro_batch, int),
                      recompute=recompute)


def _range(text: str) -> tuple[float, float]:
    parts = text.split(":")
    if len(parts) > 2:
        raise ConfigError(f"--slack must be LOW or LOW:HIGH, got {text!r}")
    low, high = (_number("--slack", part, float) for part in (parts[0], parts[-1]))
    return low, high


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise ConfigError(f"--seed must be a non-negative integer, got {text!r}")
    return seed


def _non_negative(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{flag} must be a non-negative number, got {text!r}")
    return value


COMMANDS = (Command(name="cluster-sim", add_arguments=add_arguments, run=run, traces=True,
                    help="simulate training jobs on a shared cluster under scheduling policies"),)

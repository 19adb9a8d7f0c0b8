"""``vtrain trace CONFIG``: the operator graph of a plan, per pipeline stage, and the kernels the
plan's software stack runs for it."""

from __future__ import annotations

import argparse
import json

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cli.common import CONFIG_HELP, emit
from vtrain_plugin.cli.render import trace_json, trace_table
from vtrain_plugin.hardware.devices import get_device


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help=CONFIG_HELP)
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    run_config = load_run_config(args.config)
    graph = trace(run_config.model, run_config.parallel)
    training = run_config.training
    stack = training.stack_for(run_config.model, get_device(run_config.cluster.gpu).architecture,
                              run_config.parallel)
    kernels = {"unfused_attention": training.unfused_attention, "unfused": training.unfused_kernels}
    if args.format == "json":
        emit(json.dumps(trace_json(graph, stack, training.fp8_settings,
                                   distributed_optimizer=training.distributed_optimizer,
                                   grads=training.grad_dtype(graph.dtype),
                                   fp8_param_gather=training.fp8_param_gather, **kernels), indent=1), args.output)
    else:
        emit(trace_table(graph, stack, training.fp8_settings, **kernels), args.output)
    return 0


COMMANDS = (Command(name="trace", add_arguments=add_arguments, run=run, traces=True,
                    help="trace a model into its operator graph"),)

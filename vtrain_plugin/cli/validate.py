"""``vtrain validate CONFIG``: train the plan for real on one local device and compare with its estimate."""

from __future__ import annotations

import argparse
import json
import sys

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.cli.common import CONFIG_HELP, device_and_db_options
from vtrain_plugin.cli.render import validation_table
from vtrain_plugin.measured.one_device import validate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help=CONFIG_HELP)
    device_and_db_options(p)
    p.add_argument("--iterations", type=int, default=5, metavar="N", help="timed iterations (default 5)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed iterations before them (default 1)")
    p.add_argument("--format", choices=("table", "json"), default="table")


def run(args: argparse.Namespace) -> int:
    result = validate(load_run_config(args.config), device=args.device, db_path=args.db,
                      iterations=args.iterations, warmup=args.warmup)
    if args.format == "json":
        sys.stdout.write(json.dumps(result.to_dict(), indent=1) + "\n")
    else:
        sys.stdout.write(validation_table(result) + "\n")
    return 0


COMMANDS = (Command(name="validate", add_arguments=add_arguments, run=run, traces=True,
                    help="train a plan for real on one local device and compare with its estimate"),)

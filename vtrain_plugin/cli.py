"""The ``vtrain`` command line. Each subcommand lives in a small function; user errors become one
line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from vtrain_plugin.errors import VTrainError
from vtrain_plugin.graph import atomic_write_text

EXIT_USER_ERROR = 2


def _emit(text: str, output: str | None) -> None:
    if output:
        atomic_write_text(Path(output), text if text.endswith("\n") else text + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def cmd_trace(args: argparse.Namespace) -> int:
    from vtrain_plugin.config import load_run_config
    from vtrain_plugin.report import trace_json, trace_table
    from vtrain_plugin.tracer import trace

    run = load_run_config(args.config)
    graph = trace(run.model, run.parallel)
    if args.format == "json":
        _emit(json.dumps(trace_json(graph), indent=1), args.output)
    else:
        _emit(trace_table(graph), args.output)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vtrain", description="Predict the iteration time, memory and cost of Megatron-style training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("trace", help="trace a model into its operator graph")
    p.add_argument("config", help="vTrain config JSON or vtrain plan file (YAML/JSON)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_trace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="vtrain: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except VTrainError as exc:
        print(f"vtrain: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("vtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

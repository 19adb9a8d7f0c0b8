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


def cmd_estimate(args: argparse.Namespace) -> int:
    from vtrain_plugin.config import load_run_config, with_gpu
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.profiles import measured_durations
    from vtrain_plugin.report import estimate_table

    failed = 0
    for index, path in enumerate(args.config):
        try:
            run = load_run_config(path)
            if args.gpu:
                run = with_gpu(run, args.gpu)
            measured = measured_durations(run, db_path=args.db)
            result = estimate(run, measured=measured, timeline=bool(args.timeline),
                              explain=args.explain if args.explain else 0)
            if args.timeline:
                result.write_timeline(_timeline_path(args.timeline, index, len(args.config)),
                                      max_ranks=args.timeline_max_stages,
                                      max_microbatches=args.timeline_max_microbatches)
        except VTrainError as exc:
            failed += 1
            if args.format == "jsonl":
                sys.stdout.write(json.dumps({"config": path, "error": str(exc)}) + "\n")
                sys.stdout.flush()
            else:
                print(f"vtrain: error: {exc}", file=sys.stderr)
            continue
        if args.format == "jsonl":
            sys.stdout.write(json.dumps({"config": path, **result.to_dict()}) + "\n")
            sys.stdout.flush()
        elif args.format == "json":
            sys.stdout.write(json.dumps({"config": path, **result.to_dict(), "largest_unmeasured": [
                {"op": k.op, "input_shapes": k.input_shapes, "dtypes": k.dtypes, "phase": k.phase,
                 "module": k.module, "time_ms": k.time_ms} for k in result.largest_unmeasured]}, indent=1) + "\n")
        else:
            sys.stdout.write(estimate_table(run, result) + "\n")
    return EXIT_USER_ERROR if failed else 0


def _timeline_path(path: str, index: int, total: int) -> Path:
    """One timeline per config: ``t.json`` for one config, ``t.0.json``, ``t.1.json``... for several."""
    p = Path(path)
    return p if total == 1 else p.with_name(f"{p.stem}.{index}{p.suffix}")


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

    p = sub.add_parser("estimate", help="predict the iteration time of one or more plans")
    p.add_argument("config", nargs="+", help="vTrain config JSON or vtrain plan file (YAML/JSON)")
    p.add_argument("--gpu", help="GPU preset to estimate for, overriding the config's "
                                 "(a100-sxm4-40gb, a100-sxm4-80gb, h100-sxm, h200-sxm; aliases A100, H100, H200)")
    p.add_argument("--format", choices=("table", "json", "jsonl"), default="table")
    p.add_argument("--db", help="profile database (default: $VTRAIN_PROFILE_DB or the user cache)")
    p.add_argument("--explain", type=int, nargs="?", const=10, default=0, metavar="N",
                   help="list the N largest unmeasured kernels (default 10)")
    p.add_argument("--timeline", metavar="FILE", help="write a Chrome trace / Perfetto timeline")
    p.add_argument("--timeline-max-stages", type=_positive, metavar="N",
                   help="write at most N pipeline stages (first and last always kept)")
    p.add_argument("--timeline-max-microbatches", type=_positive, metavar="N",
                   help="write at most N micro-batches per stage")
    p.set_defaults(func=cmd_estimate)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


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

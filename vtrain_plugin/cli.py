"""The ``vtrain`` command line. Each subcommand lives in a small function; user errors become one
line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from vtrain_plugin.errors import ProfileError, VTrainError
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
    from vtrain_plugin.profiles import measured_comm_tables, measured_durations
    from vtrain_plugin.report import estimate_table

    failed = 0
    for index, path in enumerate(args.config):
        try:
            run = load_run_config(path)
            if args.gpu:
                run = with_gpu(run, args.gpu)
            result = estimate(run, measured=measured_durations(run, db_path=args.db),
                              measured_comm=measured_comm_tables(run, db_path=args.db),
                              timeline=bool(args.timeline), explain=args.explain if args.explain else 0)
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


def cmd_profile(args: argparse.Namespace) -> int:
    from profiler.db import ProfileDB
    from profiler.fingerprint import current_fingerprint
    from profiler.replay import profile_kernels
    from vtrain_plugin.config import load_run_config
    from vtrain_plugin.tracer import trace
    from vtrain_plugin.validate import single_device_run

    fp = current_fingerprint(args.device)
    keys: dict = {}
    for path in args.config:
        run = load_run_config(path)
        if args.single_device:
            run, _ = single_device_run(run, args.device)
        keys.update(trace(run.model, run.parallel).unique_kernels())
    with ProfileDB.open(args.db) as db:
        summary = profile_kernels(keys, args.device, db, fp, force=args.force, progress=True)
        where = db.path
    sys.stdout.write(f"profiled {len(keys)} unique kernels of {len(args.config)} plan(s) on {fp.label} into "
                     f"{where}: {summary.measured} measured, {summary.skipped} already in the database, "
                     f"{len(summary.failed)} failed\n")
    for key, reason in summary.failed:
        sys.stdout.write(f"  failed {key.op} {[list(s) for s in key.input_shapes]}: {reason}\n")
    return 0


def cmd_profile_comm(args: argparse.Namespace) -> int:
    from profiler.comm_bench import benchmark_collectives
    from profiler.db import ProfileDB
    from profiler.fingerprint import current_fingerprint

    fp = current_fingerprint(args.device)
    with ProfileDB.open(args.db) as db:
        result = benchmark_collectives(args.device, max_nbytes=args.max_nbytes, world_size=args.world_size,
                                       db=db, fingerprint=fp)
        where = db.path
    tables = sorted({(r.kind.value, r.group_size, r.backend) for r in result.rows})
    sys.stdout.write(f"measured {len(result.rows)} collective timings ({len(tables)} tables) on {fp.label} into "
                     f"{where}\n")
    for kind, group_size, backend in tables:
        sys.stdout.write(f"  {kind} over {group_size} ranks ({backend})\n")
    for u in result.unsupported:
        sys.stdout.write(f"  unsupported {u.kind.value} over {u.group_size} ranks: {u.reason}\n")
    return 0


def cmd_profile_export(args: argparse.Namespace) -> int:
    from vtrain_plugin.profiles import open_profile_db

    db = open_profile_db(args.db)
    if db is None:
        raise ProfileError(f"profile database {args.db or 'default'} does not exist; nothing to export")
    with db:
        devices = db.fingerprints()
        if args.device_name:
            devices = db.find_fingerprints(device_name=args.device_name)
            if not devices:
                raise ProfileError(f"--device-name {args.device_name!r} matches none of the devices in "
                                   f"{db.path}: {', '.join(fp.label for fp in db.fingerprints()) or 'none'}")
        db.export(args.file, devices)
    sys.stdout.write(f"exported {len(devices)} device profile(s) to {args.file}\n")
    return 0


def cmd_profile_import(args: argparse.Namespace) -> int:
    from profiler.db import ProfileDB

    with ProfileDB.open(args.db) as db:
        counts = db.import_(args.file)
        where = db.path
    sys.stdout.write(f"imported {counts.devices} device(s), {counts.kernels} kernels and {counts.comm} collective "
                     f"timings into {where}\n")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from vtrain_plugin.config import load_run_config
    from vtrain_plugin.validate import validate, validation_table

    run = load_run_config(args.config)
    result = validate(run, device=args.device, db_path=args.db, iterations=args.iterations, warmup=args.warmup)
    if args.format == "json":
        sys.stdout.write(json.dumps(result.to_dict(), indent=1) + "\n")
    else:
        sys.stdout.write(validation_table(result) + "\n")
    return 0


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
    _db_option(p)
    p.add_argument("--explain", type=int, nargs="?", const=10, default=0, metavar="N",
                   help="list the N largest unmeasured kernels (default 10)")
    p.add_argument("--timeline", metavar="FILE", help="write a Chrome trace / Perfetto timeline")
    p.add_argument("--timeline-max-stages", type=_positive, metavar="N",
                   help="write at most N pipeline stages (first and last always kept)")
    p.add_argument("--timeline-max-microbatches", type=_positive, metavar="N",
                   help="write at most N micro-batches per stage")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("profile", help="measure the unique kernels of plans on this machine's device")
    p.add_argument("config", nargs="+", help="vTrain config JSON or vtrain plan file (YAML/JSON)")
    _device_and_db(p)
    p.add_argument("--force", action="store_true", help="measure again kernels already in the database")
    p.add_argument("--single-device", action="store_true",
                   help="profile the one-device variant of each plan (TP=PP=DP=1), what `vtrain validate` runs")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("profile-comm", help="measure collectives between the GPUs (NCCL) or processes (gloo) "
                                            "of this node")
    _device_and_db(p)
    p.add_argument("--max-nbytes", type=_positive, metavar="N",
                   help="largest message in bytes (default 1 GiB on cuda, 64 MiB on cpu)")
    p.add_argument("--world-size", type=_positive, metavar="N",
                   help="ranks (default: every GPU of the node; 2-4 processes on cpu)")
    p.set_defaults(func=cmd_profile_comm)

    p = sub.add_parser("profile-export", help="write profiles to a portable JSON file")
    p.add_argument("file", help="JSON file to write")
    _db_option(p)
    p.add_argument("--device-name", help="only devices whose name contains this (e.g. H100)")
    p.set_defaults(func=cmd_profile_export)

    p = sub.add_parser("profile-import", help="merge a file written by profile-export into the database")
    p.add_argument("file", help="JSON file written by `vtrain profile-export`")
    _db_option(p)
    p.set_defaults(func=cmd_profile_import)

    p = sub.add_parser("validate", help="train a plan for real on one local device and compare with its estimate")
    p.add_argument("config", help="vTrain config JSON or vtrain plan file (YAML/JSON)")
    _device_and_db(p)
    p.add_argument("--iterations", type=int, default=5, metavar="N", help="timed iterations (default 5)")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed iterations before them (default 1)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=cmd_validate)
    return parser


def _device_and_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to measure on (default cpu)")
    _db_option(p)


def _db_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="profile database (default: $VTRAIN_PROFILE_DB or the user cache)")


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

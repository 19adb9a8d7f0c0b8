"""``vtrain profile``, ``profile-comm``, ``profile-export`` and ``profile-import``: measuring kernels and
collectives on this machine's device, and moving profiles between machines.

The benchmarks (:mod:`profiler.replay`, :mod:`profiler.comm_bench`) are imported by the commands that
run them: they load torch, which every other command of the CLI does without.
"""

from __future__ import annotations

import argparse
import sys

from profiler.db import ProfileDB
from profiler.fingerprint import current_fingerprint
from profiler.lookup import open_profile_db
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import CONFIG_HELP, db_option, device_and_db_options, positive_int
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.measured.one_device import single_device_run


def profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="+", help=CONFIG_HELP)
    device_and_db_options(p)
    p.add_argument("--force", action="store_true", help="measure again kernels already in the database")
    p.add_argument("--single-device", action="store_true",
                   help="profile the one-device variant of each plan (TP=PP=DP=1), what `vtrain validate` runs")


def profile_comm_arguments(p: argparse.ArgumentParser) -> None:
    device_and_db_options(p)
    p.add_argument("--max-nbytes", type=positive_int, metavar="N",
                   help="largest message in bytes (default 1 GiB on cuda, 64 MiB on cpu)")
    p.add_argument("--world-size", type=positive_int, metavar="N",
                   help="ranks (default: every GPU of the node; 2-4 processes on cpu)")


def profile_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSON file to write")
    db_option(p)
    p.add_argument("--device-name", help="only devices whose name contains this (e.g. H100)")


def profile_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSON file written by `vtrain profile-export`")
    db_option(p)


def profile(args: argparse.Namespace) -> int:
    from profiler.replay import profile_kernels

    fp = current_fingerprint(args.device)
    keys: dict = {}
    for path in args.config:
        run_config = load_run_config(path)
        if args.single_device:
            run_config, _ = single_device_run(run_config, args.device)
        keys.update(trace(run_config.model, run_config.parallel).unique_kernels())
    with ProfileDB.open(args.db) as db:
        summary = profile_kernels(keys, args.device, db, fp, force=args.force, progress=True)
        where = db.path
    sys.stdout.write(f"profiled {len(keys)} unique kernels of {len(args.config)} plan(s) on {fp.label} into "
                     f"{where}: {summary.measured} measured, {summary.skipped} already in the database, "
                     f"{len(summary.failed)} failed\n")
    for key, reason in summary.failed:
        sys.stdout.write(f"  failed {key.op} {[list(s) for s in key.input_shapes]}: {reason}\n")
    return 0


def profile_comm(args: argparse.Namespace) -> int:
    from profiler.comm_bench import benchmark_collectives

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


def profile_export(args: argparse.Namespace) -> int:
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


def profile_import(args: argparse.Namespace) -> int:
    with ProfileDB.open(args.db) as db:
        counts = db.import_(args.file)
        where = db.path
    sys.stdout.write(f"imported {counts.devices} device(s), {counts.kernels} kernels and {counts.comm} collective "
                     f"timings into {where}\n")
    return 0


COMMANDS = (
    Command(name="profile", add_arguments=profile_arguments, run=profile, traces=True,
            help="measure the unique kernels of plans on this machine's device"),
    Command(name="profile-comm", add_arguments=profile_comm_arguments, run=profile_comm,
            help="measure collectives between the GPUs (NCCL) or processes (gloo) of this node"),
    Command(name="profile-export", add_arguments=profile_export_arguments, run=profile_export,
            help="write profiles to a portable JSON file"),
    Command(name="profile-import", add_arguments=profile_import_arguments, run=profile_import,
            help="merge a file written by profile-export into the database"),
)

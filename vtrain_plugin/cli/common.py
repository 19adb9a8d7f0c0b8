"""Shared bits of the subcommands: output, option helpers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Literal

from vtrain_plugin.capture import disk_cache
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.specs.reliability import CheckpointMode, FailurePreset, ReliabilitySpec

EXIT_USER_ERROR = 2
CONFIG_HELP = "vTrain config JSON or vtrain plan file (YAML/JSON)"


def emit(text: str, output: str | None) -> None:
    if output:
        atomic_write_text(Path(output), text if text.endswith("\n") else text + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def device_and_db_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to measure on (default cpu)")
    db_option(p)


def db_option(p: argparse.ArgumentParser, *, can_disable: bool = False) -> None:
    """``--db``; with ``can_disable`` (commands that estimate) also ``--no-db``, the analytical model alone."""
    group = p.add_mutually_exclusive_group() if can_disable else p
    group.add_argument("--db", help="profile database (default: $VTRAIN_PROFILE_DB, else "
                                    "$XDG_CACHE_HOME/vtrain/profiles.sqlite or ~/.cache/vtrain/profiles.sqlite)")
    if can_disable:
        group.add_argument("--no-db", action="store_true",
                           help="read no profile database: every kernel and collective from the analytical model")


def profile_db(args: argparse.Namespace) -> str | Literal[False] | None:
    """The ``profile_db`` of :func:`vtrain_plugin.estimate.estimate` that ``--db`` / ``--no-db`` ask for."""
    return False if getattr(args, "no_db", False) else args.db


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def cache_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", metavar="DIR",
                   help="cache folder of traces (and of cluster-sim's curves) (default: $VTRAIN_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/vtrain or ~/.cache/vtrain)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the on-disk trace (and curve) cache")


@contextmanager
def cache_environment(args: argparse.Namespace) -> Iterator[None]:
    """``--cache-dir`` and ``--no-cache`` as the environment the trace cache reads while the command
    runs (so the worker processes of ``vtrain search`` use the same cache); restored afterwards."""
    settings = {}
    if getattr(args, "cache_dir", None):
        settings[disk_cache.CACHE_DIR_ENV] = args.cache_dir
    if getattr(args, "no_cache", False):
        settings[disk_cache.NO_CACHE_ENV] = "1"
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


FAILURES_HELP = ("failures, restarts and checkpoints in the totals of --tokens: a preset of published failure rates "
                 "(large-scale: Llama 3's, the default; reliable; typical), on (the plan file's reliability "
                 "section, else the defaults) or off (failure-free totals only)")


def reliability_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--failures", choices=("on", "off", *(preset.value for preset in FailurePreset)),
                   help=FAILURES_HELP)
    p.add_argument("--checkpoint", choices=tuple(mode.value for mode in CheckpointMode),
                   help="sync: training waits for the checkpoint write (Megatron-LM's default); async: only for "
                        "the copy to host memory (--async-save)")
    p.add_argument("--checkpoint-interval", metavar="ITERATIONS",
                   help="iterations between checkpoints (Megatron-LM's --save-interval; default: the interval "
                        "that minimises the expected time, Daly 2006; one longer than the run is clamped to it, "
                        "with a note)")


def with_reliability(args: argparse.Namespace, reliability: ReliabilitySpec | None) -> ReliabilitySpec | None:
    """``reliability`` (a plan file's; None: off) as the reliability flags change it."""
    if args.failures == "off":
        if args.checkpoint is not None or args.checkpoint_interval is not None:
            raise ConfigError("--checkpoint and --checkpoint-interval need failures on, not --failures off")
        return None
    base = reliability or ReliabilitySpec()
    if args.failures not in (None, "on"):
        base = replace(base, failures=FailurePreset(args.failures), failure_rate_per_gpu_hour=None)
    if args.checkpoint is not None:
        base = replace(base, checkpoint=CheckpointMode(args.checkpoint))
    if args.checkpoint_interval is not None:
        try:
            interval = int(args.checkpoint_interval)
        except ValueError:
            interval = 0
        if interval <= 0:
            raise ConfigError(f"--checkpoint-interval must be a positive integer of iterations, "
                              f"got {args.checkpoint_interval!r}")
        base = replace(base, checkpoint_interval_iterations=interval)
    return base

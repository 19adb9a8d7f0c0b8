"""Shared bits of the subcommands: output, option helpers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vtrain_plugin.capture import disk_cache
from vtrain_plugin.core.files import atomic_write_text

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


def db_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="profile database (default: $VTRAIN_PROFILE_DB or the user cache)")


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

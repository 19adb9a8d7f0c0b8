"""Shared bits of the subcommands: output, option helpers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

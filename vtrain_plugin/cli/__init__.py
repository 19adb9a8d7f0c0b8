"""The ``vtrain`` command line: one module per command (argument parsing and rendering only).

Each command module declares its commands once (``COMMANDS``, :mod:`vtrain_plugin.cli.commands`);
:data:`MODULES` lists the modules in the order ``vtrain --help`` shows them. User errors become one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from vtrain_plugin.cli import (
    cache, calibrate, cluster_sim, compare, estimate, flags, profile, search, size, trace, validate)
from vtrain_plugin.cli.commands import register
from vtrain_plugin.cli.common import EXIT_USER_ERROR, cache_environment, cache_options
from vtrain_plugin.core.errors import VTrainError

MODULES = (trace, estimate, profile, validate, compare, calibrate, search, size, cluster_sim, flags, cache)
COMMANDS = register(command for module in MODULES for command in module.COMMANDS)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors (a bad choice, a missing or malformed option) as one line on stderr and exit
    code 2, like every other user error, instead of the usage text followed by the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="vtrain", description="Predict the iteration time, memory and cost of Megatron-style training.",
        allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, allow_abbrev=False)  # --gpu is not --gpus
        command.add_arguments(p)
        if command.traces:
            cache_options(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="vtrain: %(message)s", stream=sys.stderr)
    try:
        with cache_environment(args):
            return args.func(args)
    except VTrainError as exc:
        print(f"vtrain: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("vtrain: interrupted", file=sys.stderr)
        return 130

"""The ``vtrain`` command line: one module per command (argument parsing and rendering only).

Each command module declares its commands once (``COMMANDS``, :mod:`vtrain_plugin.cli.commands`);
:data:`COMMAND_MODULES` routes each command name to its module, in the order ``vtrain --help`` shows
them. A command imports its own module only (``vtrain estimate`` never loads the planning layer):
start-up is most of a warm estimate's time. User errors become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import NoReturn

from vtrain_plugin.cli.commands import Command, register
from vtrain_plugin.cli.common import EXIT_USER_ERROR, cache_environment, cache_options
from vtrain_plugin.core.errors import VTrainError
from vtrain_plugin.core.registry import Registry

# command name -> the module of vtrain_plugin.cli that declares it, in `vtrain --help` order
# (tests/unit/cli/test_commands.py checks it against every module's COMMANDS)
COMMAND_MODULES = {
    "trace": "trace", "estimate": "estimate", "profile": "profile", "profile-comm": "profile",
    "profile-export": "profile", "profile-import": "profile", "validate": "validate", "compare": "compare",
    "calibrate": "calibrate", "search": "search", "size": "size", "cluster-sim": "cluster_sim", "flags": "flags",
    "cache": "cache"}


def command_modules(names: Iterable[str] | None = None) -> tuple[ModuleType, ...]:
    """The modules that declare the commands ``names`` (default: every command), in help order."""
    wanted = COMMAND_MODULES if names is None else {n: COMMAND_MODULES[n] for n in names}
    return tuple(importlib.import_module(f"{__name__}.{module}") for module in dict.fromkeys(wanted.values()))


def commands(names: Iterable[str] | None = None) -> Registry[Command]:
    """The commands ``names`` (default: all) as their modules declare them, in help order."""
    names = None if names is None else set(names)
    return register(c for m in command_modules(names) for c in m.COMMANDS if names is None or c.name in names)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors (a bad choice, a missing or malformed option) as one line on stderr and exit
    code 2, like every other user error, instead of the usage text followed by the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(names: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of the commands ``names`` (default: every command)."""
    parser = OneLineErrorParser(
        prog="vtrain", description="Predict the iteration time, memory and cost of Megatron-style training.",
        allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands(names).values():
        p = sub.add_parser(command.name, help=command.help, allow_abbrev=False)  # --gpu is not --gpus
        command.add_arguments(p)
        if command.traces:
            cache_options(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((word for word in argv if not word.startswith("-")), None)
    # The named command's module alone; --help before it, or an unknown name, needs them all.
    only = None
    if named in COMMAND_MODULES and not {"-h", "--help"} & set(argv[:argv.index(named)]):
        only = (named,)
    args = build_parser(only).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="vtrain: %(message)s", stream=sys.stderr)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main_thread else None
    try:
        with cache_environment(args):
            return args.func(args)
    except VTrainError as exc:
        print(f"vtrain: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("vtrain: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("vtrain: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def console() -> NoReturn:
    """The ``vtrain`` program (its console script, ``python -m vtrain_plugin.cli``): :func:`main` in a
    short-lived process of its own, set up and ended as one.

    numpy's BLAS gets one thread unless ``OPENBLAS_NUM_THREADS`` says otherwise (numpy loads after
    this: ``import vtrain_plugin.cli`` does not load it): vtrain does no large linear algebra, and the
    thread pool OpenBLAS starts as numpy loads costs every process, a search's workers included (they
    inherit the setting), about 20 ms of CPU on two cores, more on many. At exit every object is
    frozen out of the interpreter's last garbage collections, which would walk and free every module,
    class and function (about 50 ms of a warm estimate's 0.25 s); the operating system frees the
    memory. Flushing the standard streams and ``atexit`` handlers run as usual."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        code = main()
    finally:
        gc.freeze()
    sys.exit(code)


class Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``, a batch scheduler), raised where the command is, so that the
    blocks it is in clean up as after Ctrl-C: a search's workers, in a process group of their own,
    are killed instead of left running."""


def _raise_terminated(signum: int, frame: object) -> NoReturn:
    raise Terminated()

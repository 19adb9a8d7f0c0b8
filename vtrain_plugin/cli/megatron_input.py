"""``vtrain estimate``'s Megatron-LM inputs: ``--megatron-args "FLAGS"`` and launch scripts (``*.sh``),
next to plan files and vTrain configs."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

from vtrain_plugin.runs import load_megatron_script, load_run_config, run_config_from_megatron_args
from vtrain_plugin.cli.common import positive_int
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.run import RunConfig

LAUNCH_SCRIPT_SUFFIXES = (".sh", ".bash")
MEGATRON_ARGS_LABEL = "--megatron-args"


def add_megatron_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron-args", metavar="FLAGS",
                   help="Megatron-LM arguments of pretrain_gpt.py as one string (a torchrun launcher in front "
                        "is allowed); a CONFIG ending in .sh is read as a launch script holding such a command")
    p.add_argument("--gpus", type=positive_int, metavar="N",
                   help="GPUs of a Megatron-LM run: data parallel = N / (TP x PP x CP); overrides a launch "
                        "script's torchrun --nnodes x --nproc-per-node (with a note)")
    add_env_option(p)


def add_env_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="an environment variable a launch script reads (SLURM_NNODES=64, MODEL_SIZE=70B); "
                        "repeatable. Variables not given are unset, as in an empty environment")


def run_inputs(args: argparse.Namespace) -> list[tuple[str, Callable[[], RunConfig]]]:
    """``(label, load)`` for each input of the command line, loaded one at a time (a failing input is
    reported and the others still run)."""
    env = script_env(args.env)
    inputs: list[tuple[str, Callable[[], RunConfig]]] = [(path, partial(_load, path, args.gpus, env))
                                                          for path in args.config]
    if args.megatron_args is not None:
        inputs.append((MEGATRON_ARGS_LABEL, partial(run_config_from_megatron_args, args.megatron_args,
                                                    gpus=args.gpus, source=MEGATRON_ARGS_LABEL)))
    if not inputs:
        raise ConfigError("give a CONFIG file or --megatron-args")
    if args.gpus is not None and args.megatron_args is None and not any(map(_is_launch_script, args.config)):
        raise ConfigError("--gpus applies to Megatron-LM arguments only (--megatron-args or a .sh launch script)")
    if env and not any(map(_is_launch_script, args.config)):
        raise ConfigError("--env applies to launch scripts only (a .sh CONFIG)")
    return inputs


def script_env(items: list[str] | None) -> dict[str, str]:
    """The ``--env NAME=VALUE`` variables."""
    env: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env {item}: expected NAME=VALUE with NAME a shell variable name")
        env[name] = value
    return env


def _is_launch_script(path: str) -> bool:
    return Path(path).suffix.lower() in LAUNCH_SCRIPT_SUFFIXES


def _load(path: str, gpus: int | None, env: dict[str, str]) -> RunConfig:
    return load_megatron_script(path, gpus=gpus, env=env) if _is_launch_script(path) else load_run_config(path)

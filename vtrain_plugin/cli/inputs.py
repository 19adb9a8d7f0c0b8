"""The inputs of every command that estimates a run, read one way (plan files, vTrain configs,
launch scripts, ``--megatron-args``, Megatron-Bridge YAML), and the options they share.

Inputs are told apart by :func:`vtrain_plugin.runs.load_run`; the shared options ``--gpu``,
``--cluster``, ``--gpus-per-node``, ``--gpus`` and ``--env`` are each added here once.

Why one module: estimate, search, compare and calibrate must give the same estimate for the same
run, whichever way the user wrote it down.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from functools import partial

from vtrain_plugin.cli.common import positive_int
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_preset_names
from vtrain_plugin.runs import (LAUNCH_SCRIPT_SUFFIXES, PLAN_SUFFIXES, Hardware, is_launch_script, load_run,
                                run_config_from_megatron_args)
from vtrain_plugin.specs.run import RunConfig

MEGATRON_ARGS_LABEL = "--megatron-args"
INPUT_SUFFIXES = (*PLAN_SUFFIXES, *LAUNCH_SCRIPT_SUFFIXES)
INPUT_HELP = ("plan file (YAML/JSON), vTrain config, Megatron-LM launch script (.sh) or Megatron-Bridge / NeMo 2 "
              "ConfigContainer YAML (to_yaml(), a checkpoint's run_config.yaml)")
GPU_HELP = ("GPU to estimate for, on its usual node, overriding the input's (a100-sxm4-40gb, a100-sxm4-80gb, "
            "h100-sxm, h200-sxm, b200-sxm; aliases A100, H100, H200, B200); Megatron-LM inputs name none: "
            "default a100-sxm4-80gb, with a note")


def add_hardware_options(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--gpu`` or ``--cluster``, and ``--gpus-per-node``."""
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--gpu", help=GPU_HELP)
    group.add_argument("--cluster", help=f"cluster preset ({', '.join(cluster_preset_names())}), overriding the "
                                         f"input's")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G",
                   help="GPUs per node (NVLink domain), overriding the cluster's (a GB200 tray holds 4)")


def add_input_options(p: argparse.ArgumentParser, *, gpu_count: bool = True) -> None:
    """The options of the inputs: ``--megatron-args``, ``--env``, the hardware options and (with
    ``gpu_count``; ``vtrain search`` has its own budget) ``--gpus``."""
    p.add_argument("--megatron-args", metavar="FLAGS",
                   help="Megatron-LM arguments of pretrain_gpt.py as one string (a torchrun launcher in front "
                        "is allowed)")
    if gpu_count:
        p.add_argument("--gpus", type=positive_int, metavar="N",
                       help="GPUs of a Megatron-LM run (--megatron-args, launch script, Bridge YAML): data "
                            "parallel = N / (TP x PP x CP); overrides a launch script's torchrun --nnodes x "
                            "--nproc-per-node (with a note)")
    add_hardware_options(p)
    add_env_option(p)


def add_env_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="an environment variable a launch script reads (SLURM_NNODES=64, MODEL_SIZE=70B); "
                        "repeatable. Variables not given are unset, as in an empty environment")


def hardware(args: argparse.Namespace) -> Hardware:
    """The hardware options as given."""
    return Hardware(gpu=getattr(args, "gpu", None), cluster=getattr(args, "cluster", None),
                    gpus_per_node=getattr(args, "gpus_per_node", None))


def is_input_file(path: str) -> bool:
    """Whether a command-line word names an input (by its suffix) rather than, say, a log."""
    return path.lower().endswith(INPUT_SUFFIXES)


def run_inputs(args: argparse.Namespace, paths: list[str] | None = None, *, gpus: int | None = None
               ) -> list[tuple[str, Callable[[], RunConfig]]]:
    """``(label, load)`` for each input of the command line (``paths``, default ``args.config``, then
    ``--megatron-args``), loaded one at a time (a failing input is reported and the others still
    run); ``gpus`` replaces ``args.gpus`` (``vtrain search``'s budget of one count)."""
    env = script_env(getattr(args, "env", None))
    gpus = getattr(args, "gpus", None) if gpus is None else gpus
    paths = list(args.config if paths is None else paths)
    chosen = hardware(args)
    inputs: list[tuple[str, Callable[[], RunConfig]]] = [
        (path, partial(load_run, path, gpus=gpus, hardware=chosen, env=env)) for path in paths]
    if args.megatron_args is not None:
        inputs.append((MEGATRON_ARGS_LABEL, partial(_megatron_args_run, args.megatron_args, gpus, chosen)))
    if not inputs:
        raise ConfigError("give an input file or --megatron-args")
    if env and not any(map(is_launch_script, paths)):
        raise ConfigError("--env applies to launch scripts only (a .sh input)")
    return inputs


def _megatron_args_run(argv: str, gpus: int | None, chosen: Hardware) -> RunConfig:
    run = run_config_from_megatron_args(argv, gpus=gpus, cluster=chosen.chosen_cluster(), source=MEGATRON_ARGS_LABEL)
    return chosen.applied(run)


def script_env(items: list[str] | None) -> dict[str, str]:
    """The ``--env NAME=VALUE`` variables."""
    env: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env {item}: expected NAME=VALUE with NAME a shell variable name")
        env[name] = value
    return env

"""Run descriptions from files: a plan file (YAML/JSON), a vTrain config JSON or Megatron-LM arguments
(a command line or a launch script), resolved into a :class:`RunConfig` against the hardware data
(cluster presets, GPU aliases).

Every error is a :class:`ConfigError` naming the file, the field and the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_for_gpu, resolve_cluster
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.megatron.launch_script import LaunchCommand, launch_command, read_command_line, read_launch_file
from vtrain_plugin.specs.megatron.args import script_plan
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.plan_file import parse_model_sections, parse_plan
from vtrain_plugin.specs.reading import read_mapping
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFile:
    """The model of a plan file or vTrain config, with its training and cluster (``vtrain search``
    takes them as defaults); the file's parallel plan is not read."""

    model: ModelSpec
    training: TrainingSpec | None  # None when the file has no training section
    cluster: ClusterSpec
    source: str


def load_run_config(path: str | Path) -> RunConfig:
    """Load and validate a plan file or vTrain config; errors are prefixed with the path."""
    path = Path(path)
    with _errors_name(path):
        return run_config_from_dict(read_mapping(path), source=str(path))


def load_model_file(path: str | Path) -> ModelFile:
    """The model part of a plan file or vTrain config (see :class:`ModelFile`); errors are
    prefixed with the path."""
    path = Path(path)
    with _errors_name(path):
        sections = parse_model_sections(read_mapping(path))
        return ModelFile(model=sections.model, training=sections.training,
                         cluster=resolve_cluster(sections.cluster), source=str(path))


def run_config_from_megatron_args(argv: str | Sequence[str], *, gpus: int | None = None,
                                  cluster: ClusterSpec | None = None, source: str = "") -> RunConfig:
    """The run that Megatron-LM arguments describe: ``argv`` is ``pretrain_gpt.py``'s flags as a list of
    words or as one command line (quotes and line continuations as bash reads them), with or without
    a ``torchrun`` / ``python -m torch.distributed.run`` launcher in front. The GPU count is ``gpus``, else
    the launcher's ``--nnodes`` x ``--nproc-per-node``; the cluster is ``cluster``, else the default
    GPU's usual node. What vtrain assumed (a ``gpus`` overriding the launcher's count, a vocabulary
    size the tokenizer implies) is logged in one note; flags vtrain does not model but that change
    performance in one warning; errors are prefixed with ``source`` when given."""
    with _errors_name(source):
        command = read_command_line(argv) if isinstance(argv, str) else launch_command(argv)
        return _megatron_run(command, gpus=gpus, cluster=cluster, source=source)


def load_megatron_script(path: str | Path, *, gpus: int | None = None, cluster: ClusterSpec | None = None,
                         env: Mapping[str, str] | None = None) -> RunConfig:
    """The run of a launch script (``train.sh``) that holds the training command: it is read, never
    run (see :mod:`vtrain_plugin.specs.megatron.launch_script`), with the environment variables ``env`` (none
    by default: ``$SLURM_NNODES`` is unset unless given); otherwise as :func:`run_config_from_megatron_args`."""
    path = Path(path)
    with _errors_name(path):
        return _megatron_run(read_launch_file(path, env), gpus=gpus, cluster=cluster, source=str(path))


def _megatron_run(commands: LaunchCommand | tuple[LaunchCommand, ...], *, gpus: int | None,
                  cluster: ClusterSpec | None, source: str) -> RunConfig:
    plan = script_plan(commands if isinstance(commands, tuple) else (commands,), gpus=gpus)
    run = RunConfig(model=plan.model, parallel=plan.parallel, training=plan.training,
                    cluster=cluster or resolve_cluster({}), source=source)
    where = f"{source}: " if source else ""
    if plan.note:
        logger.warning("note: %s%s", where, plan.note)
    if plan.warning:
        logger.warning("warning: %s%s", where, plan.warning)
    return run


@contextmanager
def _errors_name(path: Path | str) -> Iterator[None]:
    if not str(path):
        yield
        return
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def run_config_from_dict(data: Mapping[str, Any], *, source: str = "") -> RunConfig:
    """The run of a plan-file (or vTrain config) mapping, its cluster resolved."""
    plan = parse_plan(data)
    return _checked(RunConfig(model=plan.model, parallel=plan.parallel, training=plan.training,
                              cluster=resolve_cluster(plan.cluster), source=source))


def with_gpu(run: RunConfig, gpu: str) -> RunConfig:
    """The same run on another GPU: the cluster becomes that GPU's usual node (``--gpu``)."""
    if get_device(gpu).name == run.cluster.gpu:
        return run
    return _checked(replace(run, cluster=cluster_for_gpu(gpu)))


def _checked(run: RunConfig) -> RunConfig:
    """The checks that need the hardware data: a low-precision recipe needs tensor cores that run it."""
    get_device(run.cluster.gpu).require_recipe(run.training)
    return run

"""Run descriptions from files: a plan file (YAML/JSON), a vTrain config JSON, Megatron-LM arguments
(a command line or a launch script) or a Megatron-Bridge ConfigContainer YAML, resolved into a
:class:`RunConfig` against the hardware data (cluster presets, GPU aliases).

:func:`load_run` tells the kinds of file apart, so that every command and the Python API read the
same file the same way. Every error is a :class:`ConfigError` naming the file, the field and the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_for_gpu, get_cluster_preset, resolve_cluster
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.plan_file import parse_model_sections, parse_plan
from vtrain_plugin.specs.reading import YAML_SUFFIXES, is_bridge_config, read_mapping
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec

if TYPE_CHECKING:
    from vtrain_plugin.specs.megatron.launch_script import LaunchCommand

# The Megatron-LM reader (vtrain_plugin.specs.megatron: flag tables, bash reader) is imported by the
# functions that read its inputs: loading it is a quarter of the start-up of a plan file's estimate.

logger = logging.getLogger(__name__)
LAUNCH_SCRIPT_SUFFIXES = (".sh", ".bash")
PLAN_SUFFIXES = (*YAML_SUFFIXES, ".json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """Where a run is estimated, as a command's options give it (``--gpu``, ``--cluster``,
    ``--gpus-per-node``): each overrides the file's choice; none given keeps it (a Megatron-LM
    input, which names no GPU, then runs on the default GPU (:data:`vtrain_plugin.hardware.clusters.DEFAULT_GPU`)'s usual node, with a note)."""

    gpu: str | None = None  # a GPU preset or alias: that GPU's usual node
    cluster: str | None = None  # a cluster preset
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.gpu is not None and self.cluster is not None:
            raise ConfigError("give --gpu or --cluster, not both: a cluster preset names its GPU")

    def chosen_cluster(self) -> ClusterSpec | None:
        """The cluster the options name, None when they name neither GPU nor cluster."""
        cluster = (cluster_for_gpu(self.gpu) if self.gpu else get_cluster_preset(self.cluster) if self.cluster
                   else None)
        return cluster if cluster is None else self.with_nodes(cluster)

    def applied(self, run: RunConfig) -> RunConfig:
        """``run`` on the options' hardware (a plan file's own cluster is kept when ``--gpu`` names its GPU)."""
        if self.gpu:
            run = _on_gpu(run, self.gpu)
        elif self.cluster:
            run = replace(run, cluster=get_cluster_preset(self.cluster))
        return _checked(replace(run, cluster=self.with_nodes(run.cluster)), self)

    def with_nodes(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with ``--gpus-per-node``'s node size, if given."""
        return cluster if self.gpus_per_node is None else replace(cluster, gpus_per_node=self.gpus_per_node)

    @property
    def named(self) -> str:
        """How the options named the GPU, for an error about it."""
        return (f"--gpu {self.gpu}" if self.gpu else f"--cluster {self.cluster}" if self.cluster
                else "no --gpu given")


def is_launch_script(path: str | Path) -> bool:
    return Path(path).suffix.lower() in LAUNCH_SCRIPT_SUFFIXES


def load_run(path: str | Path, *, gpus: int | None = None, hardware: Hardware = Hardware(),
             env: Mapping[str, str] | None = None) -> RunConfig:
    """The run a file describes, whatever its kind: a launch script (``.sh``, ``.bash``), a
    Megatron-Bridge ConfigContainer YAML (``train`` and ``model`` sections), else a plan file or vTrain
    config; on the ``hardware`` the command's options give. ``gpus`` (the GPU count) and ``env`` (a
    script's environment) apply to Megatron-LM inputs only, whose plan leaves the data-parallel size
    to the GPU count; a plan file gives it."""
    path = Path(path)
    if is_launch_script(path):
        return hardware.applied(load_megatron_script(path, gpus=gpus, cluster=hardware.chosen_cluster(), env=env))
    if env:
        raise ConfigError(f"--env applies to launch scripts only (.sh), not {path}")
    with _errors_name(path):
        data = read_mapping(path)
    if is_bridge_config(data):
        return hardware.applied(bridge_run(data, gpus=gpus, cluster=hardware.chosen_cluster(), source=str(path)))
    if gpus is not None:
        raise ConfigError(f"--gpus applies to Megatron-LM arguments only (--megatron-args, a .sh launch script or "
                          f"a Megatron-Bridge YAML): {path} gives its data-parallel size")
    with _errors_name(path):
        return hardware.applied(run_config_from_dict(data, source=str(path)))


def load_model_source(path: str | Path, *, gpus: int | None = None, hardware: Hardware = Hardware(),
                      env: Mapping[str, str] | None = None) -> ModelFile:
    """The model, training and cluster of any file :func:`load_run` reads (``vtrain search``'s
    input): a plan file needs no parallel section; a Megatron-LM input is read as a run."""
    path = Path(path)
    if not is_launch_script(path):
        with _errors_name(path):
            data = read_mapping(path)
        if not is_bridge_config(data):
            if env:
                raise ConfigError(f"--env applies to launch scripts only (.sh), not {path}")
            with _errors_name(path):
                sections = parse_model_sections(data)
                cluster = hardware.chosen_cluster() or hardware.with_nodes(resolve_cluster(sections.cluster))
                return ModelFile(model=sections.model, training=sections.training, cluster=cluster, source=str(path))
    return model_file_of(load_run(path, gpus=gpus, hardware=hardware, env=env))


def model_file_of(run: RunConfig) -> ModelFile:
    """The model, training and cluster of a run (its parallel plan left out)."""
    return ModelFile(model=run.model, training=run.training, cluster=run.cluster, source=run.source)


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
    from vtrain_plugin.specs.megatron.launch_script import launch_command, read_command_line

    with _errors_name(source):
        command = read_command_line(argv) if isinstance(argv, str) else launch_command(argv)
        return _megatron_run(command, gpus=gpus, cluster=cluster, source=source)


def load_megatron_script(path: str | Path, *, gpus: int | None = None, cluster: ClusterSpec | None = None,
                         env: Mapping[str, str] | None = None) -> RunConfig:
    """The run of a launch script (``train.sh``) that holds the training command: it is read, never
    run (see :mod:`vtrain_plugin.specs.megatron.launch_script`), with the environment variables ``env`` (none
    by default: ``$SLURM_NNODES`` is unset unless given); otherwise as :func:`run_config_from_megatron_args`."""
    from vtrain_plugin.specs.megatron.launch_script import read_launch_file

    path = Path(path)
    with _errors_name(path):
        return _megatron_run(read_launch_file(path, env), gpus=gpus, cluster=cluster, source=str(path))


def bridge_run(data: Mapping[str, Any], *, gpus: int | None = None, cluster: ClusterSpec | None = None,
               source: str = "") -> RunConfig:
    """The run of a Megatron-Bridge / NeMo 2 ConfigContainer mapping (see
    :mod:`vtrain_plugin.specs.megatron.bridge`) on ``gpus`` GPUs (a ConfigContainer does not hold the
    world size: the launcher does)."""
    from vtrain_plugin.specs.megatron.bridge import bridge_command

    with _errors_name(source):
        if gpus is None:
            raise ConfigError("the GPU count is unknown: a Megatron-Bridge config does not hold it; give --gpus N")
        return _megatron_run(bridge_command(data), gpus=gpus, cluster=cluster, source=source)


def load_bridge_config(path: str | Path, *, gpus: int | None = None, cluster: ClusterSpec | None = None
                       ) -> RunConfig:
    """The run of a ConfigContainer YAML file (``to_yaml()``'s, a checkpoint's ``run_config.yaml``)."""
    path = Path(path)
    with _errors_name(path):
        return bridge_run(read_mapping(path), gpus=gpus, cluster=cluster, source=str(path))


def _megatron_run(commands: LaunchCommand | tuple[LaunchCommand, ...], *, gpus: int | None,
                  cluster: ClusterSpec | None, source: str) -> RunConfig:
    from vtrain_plugin.specs.megatron.args import script_plan

    plan = script_plan(commands if isinstance(commands, tuple) else (commands,), gpus=gpus)
    run = RunConfig(model=plan.model, parallel=plan.parallel, training=plan.training,
                    cluster=cluster or resolve_cluster({}), source=source)
    where = f"{source}: " if source else ""
    notes = [*([plan.note] if plan.note else []), *([] if cluster else [_default_gpu_note(run.cluster)])]
    if notes:
        logger.warning("note: %s%s", where, "; ".join(notes))
    if plan.warning:
        logger.warning("warning: %s%s", where, plan.warning)
    return _checked(run, Hardware(gpu=None if cluster is None else cluster.gpu))


def _default_gpu_note(cluster: ClusterSpec) -> str:
    """What a Megatron-LM input that names no GPU is estimated on (README: the default GPU's usual node)."""
    return (f"no GPU given: estimated on {cluster.gpu} ({get_device(cluster.gpu).default_cluster} nodes), the "
            f"default; give --gpu to choose")


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
    moved = _on_gpu(run, gpu)
    return run if moved is run else _checked(moved)


def _on_gpu(run: RunConfig, gpu: str) -> RunConfig:
    return run if get_device(gpu).name == run.cluster.gpu else replace(run, cluster=cluster_for_gpu(gpu))


def _checked(run: RunConfig, hardware: Hardware | None = None) -> RunConfig:
    """The checks that need the hardware data, before anything is traced: a low-precision recipe needs
    tensor cores that run it. With ``hardware`` (the command's options), the error says how the GPU
    was chosen."""
    try:
        get_device(run.cluster.gpu).require_recipe(run.training)
    except ConfigError as exc:
        if hardware is None:
            raise ConfigError(f"{exc}; the GPU is cluster.gpu of the plan") from None
        raise ConfigError(f"{exc}; {hardware.named}: choose one with --gpu") from None
    return run

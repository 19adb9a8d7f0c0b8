"""How the iteration is run: global batch, pipeline schedule, data-parallel gradient reduction, and
how many tokens the whole training run consumes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import MEGABYTE
from vtrain_plugin.specs import limits
from vtrain_plugin.specs.model import Family, ModelSpec


class ScheduleKind(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class SoftwareStack(StrEnum):
    """The kernels the training software runs for the traced ops (see :mod:`vtrain_plugin.cost.lowering`)."""

    LOCAL_SPEC = "local_spec"  # megatron-core's local layer spec as traced (identity)
    MEGATRON_DEEPSPEED_2023 = "megatron_deepspeed_2023"  # fused softmax/GeLU/dropout-add, apex LN and Adam


class GradReduce(StrEnum):
    AFTER_BACKWARD = "after_backward"  # one all-reduce after the last backward (Megatron-DeepSpeed)
    OVERLAP = "overlap"  # bucketed, launched during the last backward (Megatron DDP overlap_grad_reduce)


DEFAULT_BUCKET_SIZE_MB = 40.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    global_batch_size: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    grad_reduce: GradReduce = GradReduce.AFTER_BACKWARD
    bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB  # megabytes (10^6 bytes) of gradients per bucket
    # The kernels the training software runs for the traced ops (vtrain_plugin.cost.lowering);
    # None: the plan's default, see stack_for.
    software_stack: SoftwareStack | None = None
    # Tokens of the whole training run (a float: counts such as 270e9 are written that way);
    # None: the estimate covers one iteration only.
    total_tokens: float | None = None

    def __post_init__(self) -> None:
        limits.GLOBAL_BATCH_SIZE.positive_int("training.global_batch_size", self.global_batch_size)
        object.__setattr__(self, "schedule", ScheduleKind(
            v.one_of("training.schedule", self.schedule, [s.value for s in ScheduleKind])))
        object.__setattr__(self, "grad_reduce", GradReduce(
            v.one_of("training.grad_reduce", self.grad_reduce, [g.value for g in GradReduce])))
        limits.BUCKET_SIZE_MB.positive_number("training.bucket_size_mb", self.bucket_size_mb)
        if self.software_stack is not None:
            object.__setattr__(self, "software_stack", SoftwareStack(
                v.one_of("training.software_stack", self.software_stack, [s.value for s in SoftwareStack])))
        if self.total_tokens is not None:
            object.__setattr__(self, "total_tokens", limits.TOTAL_TOKENS.check(
                "training.total_tokens", v.positive_finite_number("training.total_tokens", self.total_tokens)))

    @property
    def bucket_nbytes(self) -> int:
        return int(self.bucket_size_mb * MEGABYTE)

    def num_microbatches(self, data_parallel: int, micro_batch_size: int) -> int:
        per_step = data_parallel * micro_batch_size
        batch = v.show(self.global_batch_size)
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size ({batch}) must be divisible by data_parallel_size "
                f"({data_parallel}) * micro_batch_size ({micro_batch_size}) = {per_step}")
        microbatches = self.global_batch_size // per_step
        limits.MICRO_BATCHES.check_derived(
            f"global_batch_size ({batch}) / (data_parallel_size ({data_parallel}) * micro_batch_size "
            f"({micro_batch_size}))", microbatches)
        return microbatches

    def train_iterations(self, seq_length: int) -> int | None:
        """Iterations that consume ``total_tokens`` at ``global_batch_size * seq_length`` tokens each,
        rounded up: the last global batch is a full one, so at least ``total_tokens`` are trained
        (Megatron-LM's ``--train-samples`` rounds down instead, at most one batch fewer). None
        without ``total_tokens``."""
        if self.total_tokens is None:
            return None
        return math.ceil(self.total_tokens / (self.global_batch_size * seq_length))

    def stack_for(self, model: ModelSpec | None) -> SoftwareStack:
        """The software stack of this run: the one given, else the plan's default
        (:func:`default_software_stack`), the same for the Python API, the CLI and a search."""
        return self.software_stack or default_software_stack(model)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedule"] = self.schedule.value
        d["grad_reduce"] = self.grad_reduce.value
        d["software_stack"] = None if self.software_stack is None else self.software_stack.value
        return d


def default_software_stack(model: ModelSpec | None) -> SoftwareStack:
    """An fp16 GPT runs the fused kernels of Megatron-DeepSpeed (2023), the software of the vTrain
    paper's A100 runs that the A100 constants are calibrated on; a bf16/fp32 or Llama model, or a
    plain module, runs megatron-core's local layer spec as traced."""
    if model is not None and model.family is Family.GPT and model.dtype is Dtype.FP16:
        return SoftwareStack.MEGATRON_DEEPSPEED_2023
    return SoftwareStack.LOCAL_SPEC


def check_schedule(schedule: ScheduleKind, pipeline_parallel: int, virtual_pipeline: int,
                   num_microbatches: int) -> None:
    """What the pipeline schedules of megatron-core require of the plan, and the bound on the size of
    the simulated schedule: checked when a run is put together, before anything is traced, and
    again by the schedule builders for callers of the simulation itself."""
    pp, vp, m = pipeline_parallel, virtual_pipeline, num_microbatches
    if schedule is ScheduleKind.INTERLEAVED_1F1B:
        if vp < 2:
            raise ConfigError(f"training.schedule {schedule.value} requires virtual_pipeline >= 2, got {vp}")
        if m % pp:
            raise ConfigError(f"training.schedule {schedule.value} requires num_microbatches ({m}) to be a multiple "
                              f"of pipeline_parallel ({pp})")
    elif vp != 1:
        raise ConfigError(f"training.schedule {schedule.value} requires virtual_pipeline == 1, got {vp} "
                          f"(use {ScheduleKind.INTERLEAVED_1F1B.value})")
    limits.SCHEDULED_PASSES.check_derived(
        f"num_microbatches ({m}) * pipeline_parallel ({pp}) * virtual_pipeline ({vp})", m * pp * vp)


ADAM_MOMENTS_BYTES = 8  # two fp32 moments per parameter
MAIN_WEIGHT_BYTES = 4  # fp32 master copy when the model dtype is fp16/bf16


def model_state_bytes_per_parameter(dtype: Dtype) -> int:
    """Weights and gradients in the model dtype, fp32 main weights (mixed precision) and two fp32
    Adam moments: 16 bytes per parameter in fp16/bf16 and in fp32. The one formula of the package
    (cost/memory.py and the real-training refusal check use it)."""
    return 2 * dtype.nbytes + optimizer_bytes_per_parameter(dtype)


def optimizer_bytes_per_parameter(dtype: Dtype) -> int:
    return ADAM_MOMENTS_BYTES + (0 if dtype is Dtype.FP32 else MAIN_WEIGHT_BYTES)

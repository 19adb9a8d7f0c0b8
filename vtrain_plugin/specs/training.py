"""How the iteration is run: global batch, pipeline schedule, data-parallel gradient reduction, the
software and precision the kernels run in, and how many tokens the whole training run consumes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import MEGABYTE
from vtrain_plugin.specs import limits
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.activation_offload import ActivationOffload
from vtrain_plugin.specs.fsdp import FsdpImplementation, FsdpSettings
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.reliability import ReliabilitySpec


class ScheduleKind(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class SoftwareStack(StrEnum):
    """The kernels the training software runs for the traced ops (see :mod:`vtrain_plugin.cost.lowering.stacks`)."""

    LOCAL_SPEC = "local_spec"  # megatron-core's local layer spec as traced (identity)
    MEGATRON_DEEPSPEED_2023 = "megatron_deepspeed_2023"  # fused softmax/GeLU/dropout-add, apex LN and Adam
    MEGATRON_CORE_TE = "megatron_core_te"  # Megatron-Core + TransformerEngine: fused attention, norm, RoPE, CE, Adam
    MEGATRON_CORE_LOCAL = "megatron_core_local"  # Megatron-Core's local spec: Megatron's fused kernels, mcore's Adam


class Fp8Format(StrEnum):
    """TransformerEngine's FP8 formats: which tensors its GEMMs read in which 1-byte format."""

    HYBRID = "hybrid"  # E4M3 activations and weights, E5M2 gradients (TE Format.HYBRID)
    E4M3 = "e4m3"  # E4M3 everywhere


class Fp8Recipe(StrEnum):
    """How TransformerEngine scales a tensor into FP8 (Megatron-LM's --fp8-recipe)."""

    DELAYED = "delayed"  # from the amax history of earlier steps, amax taken inside the cast kernels
    TENSORWISE = "tensorwise"  # current scaling: each tensor's amax computed just before its cast
    MXFP8 = "mxfp8"  # 32-element blocks with E8M0 scales, applied by Blackwell's tensor cores
    BLOCKWISE = "blockwise"  # DeepSeek-V3 style: 1x128 activation and 128x128 weight tiles, fp32 scales


class Fp4Format(StrEnum):
    """FP4 element formats (Megatron-LM's --fp4-format)."""

    E2M1 = "e2m1"


class Fp4Recipe(StrEnum):
    """How TransformerEngine scales a tensor into FP4 (Megatron-LM's --fp4-recipe)."""

    NVFP4 = "nvfp4"  # 16-element blocks with E4M3 scales and a per-tensor fp32 scale (Blackwell)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8Settings:
    """The low-precision GEMMs of a run (``TrainingSpec.fp8_settings``): the FP8 format and the
    scaling recipe, an FP8 recipe or, for FP4 runs, NVFP4 (format then E4M3, NVFP4's scale format)."""

    format: Fp8Format
    recipe: Fp8Recipe | Fp4Recipe = Fp8Recipe.DELAYED
    # The first and last decoder layers of the whole model whose GEMMs stay in the model dtype.
    bf16_layers_at_start: int = 0
    bf16_layers_at_end: int = 0


class CudaGraphImpl(StrEnum):
    """Who captures CUDA graphs (Megatron-LM's --cuda-graph-impl)."""

    NONE = "none"
    LOCAL = "local"  # megatron-core's CudaGraphManager (--enable-cuda-graph)
    TRANSFORMER_ENGINE = "transformer_engine"  # TE's make_graphed_callables (--external-cuda-graph)


# megatron-core 0.16's CudaGraphScope; no scope: every transformer layer whole.
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


class GradReduce(StrEnum):
    AFTER_BACKWARD = "after_backward"  # one all-reduce after the last backward (Megatron-DeepSpeed)
    OVERLAP = "overlap"  # bucketed, launched during the last backward (Megatron DDP overlap_grad_reduce)


# Megatron-Core's DDP bucket when none is given: max(4e7, 1e6 x DP) parameters
# (DistributedDataParallel.__init__; DP without context parallelism).
# Megatron's jit-fused kernels a run may turn off (training.unfused_kernels), by TransformerConfig field.
UNFUSABLE = ("bias_activation", "bias_dropout", "rope", "masked_softmax")
DEFAULT_BUCKET_ELEMENTS = 40_000_000
DEFAULT_BUCKET_ELEMENTS_PER_DP_RANK = 1_000_000


def default_bucket_elements(data_parallel: int) -> int:
    """Parameters per gradient bucket when none is given, as Megatron-Core's DDP: max(4e7, 1e6 x DP).
    The one default of every input path (plan file, Megatron-LM arguments) and of both reductions
    (all-reduce, and the distributed optimizer's reduce-scatter)."""
    return max(DEFAULT_BUCKET_ELEMENTS, DEFAULT_BUCKET_ELEMENTS_PER_DP_RANK * data_parallel)


def default_bucket_size_mb(data_parallel: int, grad_nbytes: int) -> float:
    """:func:`default_bucket_elements` in megabytes (10^6 bytes) of gradients of ``grad_nbytes`` each."""
    return default_bucket_elements(data_parallel) * grad_nbytes / MEGABYTE


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    global_batch_size: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    grad_reduce: GradReduce = GradReduce.AFTER_BACKWARD
    # Megabytes (10^6 bytes) of gradients per bucket; None: Megatron-Core's max(4e7, 1e6 x DP)
    # parameters in the gradient dtype (default_bucket_elements), with or without the distributed optimizer.
    bucket_size_mb: float | None = None
    # The kernels the training software runs for the traced ops (vtrain_plugin.cost.lowering.stacks);
    # None: the plan's default, see stack_for.
    software_stack: SoftwareStack | None = None
    # FP8 GEMMs (TransformerEngine, megatron_core_te only; weights stay in the model dtype with fp32
    # main weights); None: GEMMs in the model dtype.
    fp8: Fp8Format | None = None
    fp8_recipe: Fp8Recipe = Fp8Recipe.DELAYED
    # The first / last decoder layers of the model run outside FP8, in the model dtype (Megatron-LM's
    # --first-last-layers-bf16 with --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16;
    # megatron-core's is_first_last_bf16_layer); need fp8 with a current-scaling recipe.
    fp8_bf16_layers_at_start: int = 0
    fp8_bf16_layers_at_end: int = 0
    # TransformerEngine keeps the weights of its FP8 linears in FP8 (Float8Tensor parameters), and the
    # distributed optimizer all-gathers them in FP8 (Megatron-LM's --fp8-param-gather, TransformerConfig's
    # fp8_param); needs fp8.
    fp8_param_gather: bool = False
    # FP4 GEMMs (TransformerEngine's NVFP4 recipe: Megatron-LM's --fp4-format e2m1 with --fp4-recipe);
    # None: none. Not with fp8 (megatron-core refuses both at once).
    fp4: Fp4Format | None = None
    fp4_recipe: Fp4Recipe = Fp4Recipe.NVFP4
    # CUDA graphs: the host launches the kernels of the captured parts as one graph each
    # (vtrain_plugin.cost.cuda_graphs); cuda_graph_scope names them (CUDA_GRAPH_SCOPES; empty: each
    # transformer layer whole, megatron-core's default).
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.NONE
    cuda_graph_scope: tuple[str, ...] = ()
    # Eager iterations before TransformerEngine's graphs are captured (Megatron-LM's
    # --cuda-graph-warmup-steps); with none, no step runs the captured parts eagerly.
    cuda_graph_warmup_steps: int = 3
    # Gradients of a bf16 model accumulated and data-parallel reduced in bf16 rather than fp32
    # (Megatron-LM's --grad-reduce-in-bf16, megatron-core DDP's grad_reduce_in_fp32=False); see grad_dtype.
    grad_reduce_in_bf16: bool = False
    # Megatron-Core's fused vocabulary-parallel cross-entropy (Megatron-LM's --cross-entropy-loss-fusion,
    # TransformerConfig's cross_entropy_loss_fusion) rather than the unfused one that keeps fp32 logits.
    cross_entropy_fusion: bool = False
    # The output layer's weight-gradient GEMMs deferred to the pipeline flush (Megatron-LM's
    # --defer-embedding-wgrad-compute, last pipeline stage): the stage keeps each deferred
    # micro-batch's logits gradient and output-layer input until then; wgrad_deferral_limit caps the
    # micro-batches deferred (--wgrad-deferral-limit; 0: every one).
    defer_embedding_wgrad: bool = False
    wgrad_deferral_limit: int = 0
    # Tokens of the whole training run (a float: counts such as 270e9 are written that way);
    # None: the estimate covers one iteration only.
    total_tokens: float | None = None
    # Megatron-Core's distributed optimizer (ZeRO-1): fp32 main weights and Adam state sharded over
    # DP, gradients reduce-scattered and parameters all-gathered (a no-op with DP 1); with
    # overlap_param_gather the all-gather of each bucket overlaps the first forward passes.
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    # TransformerEngine's userbuffers: the all-gather / reduce-scatter of sequence parallelism
    # overlapped with the GEMMs they feed (Megatron-Core's --tp-comm-overlap; needs SP).
    tp_comm_overlap: bool = False
    # Fully sharded data parallelism (Megatron-FSDP or torch FSDP2, vtrain_plugin.specs.fsdp); None: DDP.
    fsdp: FsdpSettings | None = None
    # Interleaved schedule: micro-batches that run through a virtual stage before the next one
    # (Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage); None: pipeline_parallel.
    microbatch_group_size: int | None = None
    # Failures, restarts and checkpoints of the whole run (a plan file's top-level ``reliability``
    # section): the expected days and cost beside the failure-free ones; None: failures off.
    reliability: ReliabilitySpec | None = field(default_factory=ReliabilitySpec)
    # The optimizer and its state dtypes (vtrain_plugin.specs.optimizer); a plan file gives a mapping.
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    # Megatron-LM's --deterministic-mode: NCCL pinned to ring, TE's deterministic attention backward,
    # deterministic embedding backward (vtrain_plugin.cost.lowering.deterministic).
    deterministic: bool = False
    # TransformerEngine's unfused attention (--attention-backend unfused or local): score and context
    # GEMMs, a fused masked softmax and dropout, the score-sized tensors kept for backward.
    unfused_attention: bool = False
    # Fine-grained activation offloading to host memory (Megatron-LM's --fine-grained-activation-offloading
    # with --offload-modules; vtrain_plugin.specs.activation_offload); None: off.
    activation_offload: ActivationOffload | None = None
    # Megatron-LM's --log-params-norm and --log-num-zeros-in-grad: a read of the rank's fp32 parameters
    # / gradients each step (vtrain_plugin.cost.lowering.logging_step).
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    # Gradient-accumulation fusion (off with Megatron-LM's --no-gradient-accumulation-fusion): linear
    # weights' gradient GEMMs accumulate into DDP's main_grad; without it DDP's hook adds each
    # (vtrain_plugin.cost.lowering.grad_hooks).
    gradient_accumulation_fusion: bool = True
    # Megatron-LM's NaN / Inf checks (on unless --no-check-for-nan-in-loss-and-grad): each local loss
    # and each gradient bucket's norm read back by the host (vtrain_plugin.cost.step_checks).
    nan_checks: bool = True
    # Megatron-LM's --calculate-per-token-loss: gradients scaled by the global token count after
    # their reduction, which is broadcast and all-reduced (vtrain_plugin.cost.step_checks).
    per_token_loss: bool = False
    # Megatron-LM's --manual-gc: Python's collector off in the steps, a full collection every
    # manual_gc_interval steps (--manual-gc-interval; 0: never; read only with manual_gc)
    # (vtrain_plugin.cost.step_checks).
    manual_gc: bool = False
    manual_gc_interval: int = 0
    # Megatron's jit-fused kernels turned off (TransformerConfig's bias_activation_fusion,
    # bias_dropout_fusion, apply_rope_fusion, masked_softmax_fusion; UNFUSABLE): the stack runs those
    # ops unfused, as traced (vtrain_plugin.cost.lowering.fusion.jit_fusions).
    unfused_kernels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", OptimizerSpec(**self.optimizer))
        if not isinstance(self.optimizer, OptimizerSpec):
            raise ConfigError(f"training.optimizer must be an OptimizerSpec or a mapping, got "
                              f"{type(self.optimizer).__name__}")
        v.boolean("training.deterministic", self.deterministic)
        v.boolean("training.gradient_accumulation_fusion", self.gradient_accumulation_fusion)
        v.boolean("training.nan_checks", self.nan_checks)
        v.boolean("training.per_token_loss", self.per_token_loss)
        v.boolean("training.manual_gc", self.manual_gc)
        v.non_negative_int("training.manual_gc_interval", self.manual_gc_interval)
        v.boolean("training.log_params_norm", self.log_params_norm)
        v.boolean("training.log_num_zeros_in_grad", self.log_num_zeros_in_grad)
        v.boolean("training.unfused_attention", self.unfused_attention)
        if isinstance(self.unfused_kernels, str):
            raise ConfigError(f"training.unfused_kernels must be a list of {', '.join(UNFUSABLE)}, "
                              f"got {self.unfused_kernels!r}")
        object.__setattr__(self, "unfused_kernels", tuple(sorted(set(
            v.one_of("training.unfused_kernels", name, list(UNFUSABLE)) for name in self.unfused_kernels))))
        if self.optimizer.precision_aware and not self.distributed_optimizer:
            raise ConfigError("training.optimizer.precision_aware requires training.distributed_optimizer: true "
                              "(megatron-core's OptimizerConfig asserts it)")
        limits.GLOBAL_BATCH_SIZE.positive_int("training.global_batch_size", self.global_batch_size)
        object.__setattr__(self, "schedule", ScheduleKind(
            v.one_of("training.schedule", self.schedule, [s.value for s in ScheduleKind])))
        object.__setattr__(self, "grad_reduce", GradReduce(
            v.one_of("training.grad_reduce", self.grad_reduce, [g.value for g in GradReduce])))
        if self.bucket_size_mb is not None:
            limits.BUCKET_SIZE_MB.positive_number("training.bucket_size_mb", self.bucket_size_mb)
        if self.software_stack is not None:
            object.__setattr__(self, "software_stack", SoftwareStack(
                v.one_of("training.software_stack", self.software_stack, [s.value for s in SoftwareStack])))
        if self.fp8 is not None:
            object.__setattr__(self, "fp8", Fp8Format(
                v.one_of("training.fp8", self.fp8, [f.value for f in Fp8Format])))
            if self.software_stack not in (None, SoftwareStack.MEGATRON_CORE_TE):
                raise ConfigError(f"training.fp8 {self.fp8.value!r} needs training.software_stack "
                                  f"megatron_core_te (got {self.software_stack.value})")
        if v.boolean("training.fp8_param_gather", self.fp8_param_gather) and self.fp8 is None:
            raise ConfigError("training.fp8_param_gather requires training.fp8 (FP8 weights exist only in FP8 training)")
        v.boolean("training.grad_reduce_in_bf16", self.grad_reduce_in_bf16)
        object.__setattr__(self, "cuda_graph_impl", CudaGraphImpl(
            v.one_of("training.cuda_graph_impl", self.cuda_graph_impl, [i.value for i in CudaGraphImpl])))
        object.__setattr__(self, "cuda_graph_scope", tuple(
            v.one_of("training.cuda_graph_scope", scope, CUDA_GRAPH_SCOPES) for scope in self.cuda_graph_scope))
        if "full_iteration" in self.cuda_graph_scope and self.cuda_graph_impl is CudaGraphImpl.TRANSFORMER_ENGINE:
            raise ConfigError("training.cuda_graph_scope full_iteration needs training.cuda_graph_impl local "
                              "(megatron-core captures a whole iteration only with its own graphs)")
        v.boolean("training.cross_entropy_fusion", self.cross_entropy_fusion)
        v.boolean("training.defer_embedding_wgrad", self.defer_embedding_wgrad)
        v.non_negative_int("training.wgrad_deferral_limit", self.wgrad_deferral_limit)
        v.non_negative_int("training.cuda_graph_warmup_steps", self.cuda_graph_warmup_steps)
        object.__setattr__(self, "fp8_recipe", Fp8Recipe(
            v.one_of("training.fp8_recipe", self.fp8_recipe, [r.value for r in Fp8Recipe])))
        object.__setattr__(self, "fp4_recipe", Fp4Recipe(
            v.one_of("training.fp4_recipe", self.fp4_recipe, [r.value for r in Fp4Recipe])))
        if self.fp4 is not None:
            object.__setattr__(self, "fp4", Fp4Format(
                v.one_of("training.fp4", self.fp4, [f.value for f in Fp4Format])))
            if self.fp8 is not None:
                raise ConfigError(f"training.fp4 {self.fp4.value!r} with training.fp8 {self.fp8.value!r}: "
                                  f"FP4 and FP8 GEMMs cannot both be on (megatron-core refuses them together)")
            if self.software_stack not in (None, SoftwareStack.MEGATRON_CORE_TE):
                raise ConfigError(f"training.fp4 {self.fp4.value!r} needs training.software_stack "
                                  f"megatron_core_te (got {self.software_stack.value})")
        for name in ("fp8_bf16_layers_at_start", "fp8_bf16_layers_at_end"):
            if v.non_negative_int(f"training.{name}", getattr(self, name)) and self.fp8 is None:
                raise ConfigError(f"training.{name} requires training.fp8 (layers kept out of FP8 exist only in "
                                  f"FP8 training)")
            if getattr(self, name) and self.fp8_recipe is Fp8Recipe.DELAYED:
                raise ConfigError(f"training.{name} with training.fp8_recipe delayed: megatron-core does not run "
                                  f"first / last layers in bf16 under delayed scaling")
        if self.total_tokens is not None:
            object.__setattr__(self, "total_tokens", limits.TOTAL_TOKENS.check(
                "training.total_tokens", v.positive_finite_number("training.total_tokens", self.total_tokens)))
        v.boolean("training.distributed_optimizer", self.distributed_optimizer)
        if v.boolean("training.overlap_param_gather", self.overlap_param_gather):
            if not self.distributed_optimizer:
                raise ConfigError("training.overlap_param_gather requires training.distributed_optimizer: true")
        v.boolean("training.tp_comm_overlap", self.tp_comm_overlap)
        object.__setattr__(self, "fsdp", FsdpSettings.of(self.fsdp))
        object.__setattr__(self, "activation_offload", ActivationOffload.of(self.activation_offload))
        if self.microbatch_group_size is not None:
            v.positive_int("training.microbatch_group_size", self.microbatch_group_size)
        if self.reliability is not None and not isinstance(self.reliability, ReliabilitySpec):
            raise ConfigError(f"training.reliability must be a ReliabilitySpec or None (in a plan file, a top-level "
                              f"reliability section), got {type(self.reliability).__name__}")

    def check_model(self, model: ModelSpec) -> None:
        """Raise ConfigError when this run's options need a model dtype ``model`` lacks."""
        if self.grad_reduce_in_bf16 and model.dtype is not Dtype.BF16:
            raise ConfigError(f"training.grad_reduce_in_bf16 requires model.dtype bf16 (got {model.dtype.value})")

    def grad_dtype(self, dtype: Dtype) -> Dtype:
        """The dtype this run accumulates and data-parallel reduces the gradients of a ``dtype``
        model in: :func:`grad_dtype`, or bf16 with ``grad_reduce_in_bf16``."""
        bf16 = self.grad_reduce_in_bf16 or self.optimizer.main_grads == "bf16"
        return Dtype.BF16 if bf16 and dtype is Dtype.BF16 else grad_dtype(dtype)

    def check_plan(self, plan: ParallelPlan) -> None:
        """Raise ConfigError when this run's options need what ``plan`` lacks, or ``plan`` needs
        software this run does not run."""
        if self.tp_comm_overlap and not plan.sequence_parallel:
            raise ConfigError("training.tp_comm_overlap requires parallel.sequence_parallel (got false): "
                              "TransformerEngine overlaps the all-gather / reduce-scatter of sequence "
                              "parallelism with the GEMMs they feed")
        if (self.fsdp is not None and self.fsdp.implementation is FsdpImplementation.TORCH
                and plan.pipeline_parallel > 1):
            raise ConfigError(f"training.fsdp.implementation torch with parallel.pipeline_parallel "
                              f"{plan.pipeline_parallel}: torch FSDP2 does not run with pipeline parallelism in "
                              f"Megatron-LM")
        instances = plan.distributed_optimizer_instances
        if instances > 1 and (self.fsdp is not None or not self.distributed_optimizer):
            what = "FSDP in several instances (HSDP) is not modelled by vtrain yet" if self.fsdp is not None else \
                "it needs training.distributed_optimizer: true (megatron-core asserts it)"
            raise ConfigError(f"parallel.distributed_optimizer_instances {instances}: {what}")
        if plan.context_parallel > 1 and self.software_stack not in (None, SoftwareStack.MEGATRON_CORE_TE):
            raise ConfigError(f"parallel.context_parallel {plan.context_parallel} needs training.software_stack "
                              f"megatron_core_te (got {self.software_stack.value}): megatron-core runs "
                              f"context-parallel attention only through TransformerEngine")

    @property
    def shards_optimizer(self) -> bool:
        """Whether the optimizer step runs on a data-parallel shard: with FSDP, any strategy but
        no_shard; else the distributed optimizer."""
        if self.fsdp is not None:
            return self.fsdp.sharding_strategy.shards_optimizer
        return self.distributed_optimizer

    def bucket_nbytes(self, data_parallel: int, grad_nbytes: int) -> int:
        """Gradient bytes per bucket with ``data_parallel`` ranks and gradients of ``grad_nbytes``
        bytes per element: ``bucket_size_mb``, else :func:`default_bucket_elements`."""
        if self.bucket_size_mb is None:
            return default_bucket_elements(data_parallel) * grad_nbytes
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

    @property
    def fp8_settings(self) -> Fp8Settings | None:
        """The low-precision GEMMs (FP8, or FP4 as NVFP4 with E4M3 scales); None: the model dtype."""
        if self.fp4 is not None:
            return Fp8Settings(format=Fp8Format.E4M3, recipe=self.fp4_recipe)
        return None if self.fp8 is None else Fp8Settings(
            format=self.fp8, recipe=self.fp8_recipe, bf16_layers_at_start=self.fp8_bf16_layers_at_start,
            bf16_layers_at_end=self.fp8_bf16_layers_at_end)

    @property
    def low_precision(self) -> str | None:
        """The GEMMs' low-precision recipe as a label (``fp8 hybrid (mxfp8)``, ``fp4 e2m1 (nvfp4)``)."""
        if self.fp4 is not None:
            return f"fp4 {self.fp4.value} ({self.fp4_recipe.value})"
        return None if self.fp8 is None else f"fp8 {self.fp8.value} ({self.fp8_recipe.value})"

    def stack_for(self, model: ModelSpec | None, architecture: GpuArchitecture | str,
                  plan: ParallelPlan | None = None) -> SoftwareStack:
        """The software stack of this run of ``plan`` on a GPU of ``architecture``: the one given,
        else the plan's default (:func:`default_software_stack`; FP8 and context parallelism run
        megatron_core_te), the same for the Python API, the CLI and a search."""
        if self.software_stack is not None:
            return self.software_stack
        if self.fp8_settings is not None or (plan is not None and plan.context_parallel > 1):
            return SoftwareStack.MEGATRON_CORE_TE
        return default_software_stack(model, architecture)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedule"] = self.schedule.value
        d["grad_reduce"] = self.grad_reduce.value
        d["software_stack"] = None if self.software_stack is None else self.software_stack.value
        d["fp8"] = None if self.fp8 is None else self.fp8.value
        d["fp8_recipe"] = self.fp8_recipe.value
        d["fsdp"] = None if self.fsdp is None else self.fsdp.to_dict()
        d["activation_offload"] = None if self.activation_offload is None else self.activation_offload.to_dict()
        d["optimizer"]["kind"] = self.optimizer.kind.value
        d["fp4"] = None if self.fp4 is None else self.fp4.value
        d["fp4_recipe"] = self.fp4_recipe.value
        d["cuda_graph_impl"] = self.cuda_graph_impl.value
        d["cuda_graph_scope"] = list(self.cuda_graph_scope)
        return d


def default_software_stack(model: ModelSpec | None, architecture: GpuArchitecture | str) -> SoftwareStack:
    """What people run for this model on this GPU generation:

    - an fp16 GPT on an Ampere GPU (A100): Megatron-DeepSpeed (2023), the software of the vTrain
      paper's A100 runs that the A100 constants are calibrated on;
    - on the CPU (``vtrain validate``), or for a plain module: megatron-core's local layer spec as
      traced, which is what the real training step runs there;
    - everything else (Llama families anywhere, bf16/fp32 GPTs, any model on Hopper or Blackwell):
      Megatron-Core with TransformerEngine.
    """
    architecture = GpuArchitecture(architecture)
    if model is None or architecture is GpuArchitecture.CPU:
        return SoftwareStack.LOCAL_SPEC
    if model.family is Family.GPT and model.dtype is Dtype.FP16 and architecture is GpuArchitecture.AMPERE:
        return SoftwareStack.MEGATRON_DEEPSPEED_2023
    return SoftwareStack.MEGATRON_CORE_TE


def check_schedule(schedule: ScheduleKind, pipeline_parallel: int, virtual_pipeline: int,
                   num_microbatches: int, microbatch_group_size: int | None = None) -> None:
    """What the pipeline schedules of megatron-core require of the plan, and the bound on the size of
    the simulated schedule: checked when a run is put together, before anything is traced, and
    again by the schedule builders for callers of the simulation itself. A micro-batch group size
    (interleaved only) follows megatron-core's rules: pp <= group <= m, and the last group, m % group,
    empty or at least pp."""
    pp, vp, m, group = pipeline_parallel, virtual_pipeline, num_microbatches, microbatch_group_size
    if group is not None and schedule is not ScheduleKind.INTERLEAVED_1F1B:
        raise ConfigError(f"training.microbatch_group_size ({group}) needs training.schedule "
                          f"{ScheduleKind.INTERLEAVED_1F1B.value} (got {schedule.value})")
    if schedule is ScheduleKind.INTERLEAVED_1F1B:
        if vp < 2:
            raise ConfigError(f"training.schedule {schedule.value} requires virtual_pipeline >= 2, got {vp}")
        if group is not None:
            if not pp <= group <= m:
                raise ConfigError(f"training.microbatch_group_size ({group}) must lie between pipeline_parallel "
                                  f"({pp}) and num_microbatches ({m})")
            if 0 < m % group < pp:
                raise ConfigError(f"training.microbatch_group_size ({group}) must leave a last group of "
                                  f"num_microbatches ({m}) % {group} = {m % group} micro-batches that is 0 or at "
                                  f"least pipeline_parallel ({pp}), as megatron-core requires")
        elif m % pp:
            raise ConfigError(f"training.schedule {schedule.value} requires num_microbatches ({m}) to be a multiple "
                              f"of pipeline_parallel ({pp})")
    elif vp != 1:
        raise ConfigError(f"training.schedule {schedule.value} requires virtual_pipeline == 1, got {vp} "
                          f"(use {ScheduleKind.INTERLEAVED_1F1B.value})")
    limits.SCHEDULED_PASSES.check_derived(
        f"num_microbatches ({m}) * pipeline_parallel ({pp}) * virtual_pipeline ({vp})", m * pp * vp)


ADAM_MOMENTS_BYTES = 8  # two fp32 moments per parameter
MAIN_WEIGHT_BYTES = 4  # fp32 master copy when the model dtype is fp16/bf16


def grad_dtype(dtype: Dtype) -> Dtype:
    """The dtype Megatron accumulates and data-parallel reduces the gradients of a ``dtype`` model
    in: fp32 for bf16 (Megatron-LM turns ``--accumulate-allreduce-grads-in-fp32`` on for bf16, i.e.
    megatron-core DDP's ``grad_reduce_in_fp32``), the model dtype for fp16 (its default) and fp32."""
    return Dtype.FP32 if dtype is Dtype.BF16 else dtype


def model_state_bytes_per_parameter(dtype: Dtype, gradients: Dtype | None = None) -> int:
    """Weights in the model dtype, gradients in ``gradients`` (a run's
    :meth:`TrainingSpec.grad_dtype`; None: :func:`grad_dtype`), fp32 main weights (mixed precision)
    and two fp32 Adam moments: 16 bytes per parameter in fp16 and fp32, 18 in bf16 (Megatron-LM's
    ``theoretical_memory_usage``), 16 in bf16 with ``grad_reduce_in_bf16``. The cluster curves'
    plausibility check and the real-training refusal check use it."""
    return dtype.nbytes + (gradients or grad_dtype(dtype)).nbytes + optimizer_bytes_per_parameter(dtype)


def optimizer_bytes_per_parameter(dtype: Dtype) -> int:
    return ADAM_MOMENTS_BYTES + (0 if dtype is Dtype.FP32 else MAIN_WEIGHT_BYTES)

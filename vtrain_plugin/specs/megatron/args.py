"""Megatron-LM arguments (the command line of ``pretrain_gpt.py``) as vtrain specs.

Flags are parsed with argparse against the table of Megatron-LM's arguments
(:mod:`vtrain_plugin.specs.megatron.flags`), then mapped: the flags that shape the plan set
:class:`ModelSpec`, :class:`ParallelPlan` and :class:`TrainingSpec` fields, with Megatron-LM's own
defaults where a flag is absent (ffn size, global batch, vocabulary padding, DDP bucket size, the MoE
token dispatcher, the TransformerEngine software stack: :func:`software_stack`);
flags with a first-order effect that vtrain does not model yet are refused unless at their inactive
value; the entry points and flags of other models than a GPT decoder are refused as unsupported;
flags whose effect is second-order are listed in :attr:`MegatronPlan.unmodelled`; the rest (logging,
checkpoints, data paths, learning rate...) are accepted and change nothing. README, "Megatron-LM
arguments", has the table.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.launch_script import LaunchCommand
from vtrain_plugin.specs.megatron.flags import (
    ALIASES, MEGATRON_FLAGS, PERFORMANCE_FLAGS, RETIRED_FLAGS, TABLE, UNSUPPORTED_FLAGS, UNSUPPORTED_SCRIPTS, Arity,
    Effect, releases)
from vtrain_plugin.specs.megatron.fsdp_args import checked_only, fsdp_settings
from vtrain_plugin.specs.megatron.fusion_flags import unfused_kernels
from vtrain_plugin.specs.megatron.hybrid_args import hybrid_fields
from vtrain_plugin.specs.megatron import offload_args
from vtrain_plugin.specs.megatron.attention import consumed_by_attention
from vtrain_plugin.specs.megatron.flag_values import non_negative_int, positive_int
from vtrain_plugin.specs.megatron.model import Given, model_fields, recompute_mode, recompute_modules
from vtrain_plugin.specs.megatron.moe_flags import capacity_factor, flex_dispatcher_fields, layer_freq, number
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.model_features import REFUSED, unmodelled_warning
from vtrain_plugin.specs.parallel import ParallelPlan, TokenDispatcher
from vtrain_plugin.specs.pipeline_split import layout_stages
from vtrain_plugin.specs.reliability import CheckpointMode, ReliabilitySpec
from vtrain_plugin.specs.training import GradReduce, ScheduleKind, SoftwareStack, TrainingSpec, default_bucket_size_mb


def _as_given(flag: str, value: Any) -> Any:
    return value


def _negated(flag: str, value: Any) -> bool:
    """A ``--no-...`` switch: given, the feature is off."""
    return not value


def _cp_comm_type(flag: str, value: Any) -> str:
    """Megatron-LM takes one type, or one per layer; vtrain's layers are alike, so one type."""
    kinds = set(value) if isinstance(value, list) else {value}
    if len(kinds) != 1:
        raise ConfigError(f"{flag} {' '.join(value)}: one type for every layer is modelled")
    return kinds.pop()


def _hierarchical_cp_sizes(flag: str, value: Any) -> tuple[int, ...]:
    """Megatron-LM's list of CP levels (nargs='+'), innermost first; the plan checks their product."""
    return tuple(positive_int(flag, v) for v in (value if isinstance(value, list) else [value]))


def _cross_entropy_impl(flag: str, value: Any) -> str:
    """Megatron-Core's fused cross-entropy (native) or TransformerEngine's: the same fp32 logits
    avoided (training.cross_entropy_fusion), kernels of a similar, memory-bound, cost."""
    if value not in ("native", "te"):
        raise ConfigError(f"{flag} must be native or te, got {value!r}")
    return "native"


def _attention_backend(flag: str, value: Any) -> bool:
    """Whether the attention is unfused (training.unfused_attention): TransformerEngine's fused (flash
    or cuDNN) attention is what megatron_core_te costs, auto picks one of them; unfused (TE's
    UnfusedDotProductAttention) and local (megatron-core's DotProductAttention) run the same
    score GEMM, fused masked softmax, dropout and context GEMM."""
    if value not in ("auto", "flash", "fused", "unfused", "local"):
        raise ConfigError(f"{flag} must be one of auto, flash, fused, unfused, local, got {value!r}")
    return value in ("unfused", "local")


def _optimizer(flag: str, value: Any) -> str:
    """Adam, SGD and Muon (dist_muon: Muon under the distributed optimizer, as Megatron-LM now spells
    it ``--optimizer muon --use-distributed-optimizer``)."""
    kinds = {"adam": "adam", "sgd": "sgd", "muon": "muon", "dist_muon": "muon"}
    if value not in kinds:
        raise ConfigError(f"{flag} {value}: only adam, sgd, muon and dist_muon are modelled by vtrain")
    return kinds[value]


def _state_dtype(flag: str, value: Any) -> str:
    if value not in ("fp32", "fp16", "bf16", "fp8"):
        raise ConfigError(f"{flag} must be one of fp32, fp16, bf16, fp8, got {value!r}")
    return value


def _graph_impl(impl: str) -> Callable[[str, Any], str]:
    """The deprecated switches of megatron-core's CUDA graphs: --enable-cuda-graph is local,
    --external-cuda-graph transformer_engine."""
    return lambda flag, value: impl if value else "none"


def _layout(flag: str, value: Any) -> str:
    """The layout string, without the backslashes a shell-escaped copy of it carries (``Et*3\\|\\(tt\\|\\)*6L``,
    as test harnesses write it): no layout symbol is a backslash."""
    return str(value).replace("\\", "")


def _graph_impl_named(flag: str, value: Any) -> str:
    """``--cuda-graph-impl``; ``full_iteration`` (Megatron-LM main) is megatron-core's local graphs
    capturing the whole iteration, the scope :func:`_training` adds."""
    return "local" if value == "full_iteration" else value


def _graph_scopes(flag: str, value: Any) -> tuple[str, ...]:
    """Megatron-LM's scopes, space- or comma-separated; ``full`` is the whole layer (no scope)."""
    words = value if isinstance(value, list) else [value]
    scopes = tuple(s for w in words for s in str(w).split(",") if s)
    return () if scopes == ("full",) else scopes


@dataclass(frozen=True, slots=True)
class FlagField:
    """A flag that sets one spec field as given (``"section.field"``), or that shapes the plan in a way
    vtrain does not model yet (``field`` None): refused unless at ``inactive``. Modelling one later is
    naming its field here."""

    flag: str
    field: str | None
    inactive: Any = None  # None: refused whenever given
    what: str = ""  # what is not modelled, for the refusal
    convert: Callable[[str, Any], Any] = positive_int


FIELDS: tuple[FlagField, ...] = (
    FlagField("--num-layers", "model.num_layers"),
    FlagField("--hidden-size", "model.hidden_size"),
    FlagField("--num-attention-heads", "model.num_attention_heads"),
    FlagField("--seq-length", "model.seq_length"),
    FlagField("--tensor-model-parallel-size", "parallel.tensor_parallel"),
    FlagField("--pipeline-model-parallel-size", "parallel.pipeline_parallel"),
    FlagField("--micro-batch-size", "parallel.micro_batch_size"),
    FlagField("--global-batch-size", "training.global_batch_size"),
    FlagField("--context-parallel-size", "parallel.context_parallel"),
    FlagField("--cp-comm-type", "parallel.cp_comm_type", convert=_cp_comm_type),
    FlagField("--hierarchical-context-parallel-sizes", "parallel.hierarchical_context_parallel_sizes",
              convert=_hierarchical_cp_sizes),
    FlagField("--tp-comm-overlap", "training.tp_comm_overlap", convert=_as_given),
    FlagField("--num-experts", "model.num_experts"),
    FlagField("--moe-router-topk", "model.moe_router_topk"),
    FlagField("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size"),
    FlagField("--expert-model-parallel-size", "parallel.expert_parallel"),
    FlagField("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel"),
    FlagField("--moe-token-dispatcher-type", "parallel.moe_token_dispatcher", convert=_as_given),
    FlagField("--moe-flex-dispatcher-backend", "parallel.moe_flex_dispatcher_backend", convert=_as_given),
    FlagField("--overlap-moe-expert-parallel-comm", "parallel.overlap_moe_expert_parallel_comm", convert=_as_given),
    FlagField("--delay-wgrad-compute", "parallel.delay_wgrad_compute", convert=_as_given),
    # MoE layer features (megatron-core's MoELayer builds them; ModelSpec checks them)
    FlagField("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_intermediate_size"),
    FlagField("--moe-shared-expert-overlap", "model.moe_shared_expert_overlap", convert=_as_given),
    FlagField("--moe-layer-freq", "model.moe_layer_freq", convert=layer_freq),
    FlagField("--moe-grouped-gemm", "model.moe_grouped_gemm", convert=_as_given),
    FlagField("--moe-permute-fusion", "model.moe_permute_fusion", convert=_as_given),
    FlagField("--moe-router-fusion", "model.moe_router_fusion", convert=_as_given),
    FlagField("--moe-router-score-function", "model.moe_router_score_function", convert=_as_given),
    FlagField("--moe-router-num-groups", "model.moe_router_num_groups"),
    FlagField("--moe-router-group-topk", "model.moe_router_group_topk"),
    FlagField("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias", convert=_as_given),
    FlagField("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor", convert=number),
    FlagField("--moe-router-dtype", "model.moe_router_dtype", convert=_as_given),
    FlagField("--moe-router-pre-softmax", "model.moe_router_pre_softmax", convert=_as_given),
    FlagField("--moe-expert-capacity-factor", "model.moe_expert_capacity_factor", convert=capacity_factor),
    FlagField("--moe-pad-expert-input-to-capacity", "model.moe_pad_expert_input_to_capacity", convert=_as_given),
    FlagField("--moe-token-drop-policy", "model.moe_token_drop_policy", convert=_as_given),
    FlagField("--use-distributed-optimizer", "training.distributed_optimizer", convert=_as_given),
    FlagField("--overlap-param-gather", "training.overlap_param_gather", convert=_as_given),
    FlagField("--num-distributed-optimizer-instances", "parallel.distributed_optimizer_instances"),
    # FSDP: read together by fsdp_args.fsdp_settings
    *(FlagField(flag, None, None, "", checked_only) for flag in (
        "--use-torch-fsdp2", "--use-custom-fsdp", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "--fsdp-double-buffer", "--suggested-communication-unit-size",
        "--torch-fsdp2-no-reshard-after-forward", "--outer-dp-sharding-strategy", "--enable-full-sharding-in-hsdp",
        "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-main-params-dtype")),
    # fine-grained activation offloading: read together by offload_args.activation_offload
    *(FlagField(flag, None, None, "", offload_args.checked_only) for flag in offload_args.READ_FLAGS),
    FlagField("--optimizer-cpu-offload", None, False, "optimizer offloading", _as_given),
    FlagField("--optimizer", "optimizer.kind", convert=_optimizer),
    FlagField("--muon-num-ns-steps", "optimizer.muon_ns_steps"),
    FlagField("--muon-tp-mode", None, "duplicated", "Muon with TP shards orthogonalised other than whole", _as_given),
    FlagField("--muon-fp32-matmul-prec", None, "medium", "Muon's Newton-Schulz GEMMs at another fp32 precision",
              _as_given),
    FlagField("--fp8-format", "training.fp8", convert=_as_given),
    FlagField("--fp8-recipe", "training.fp8_recipe", convert=_as_given),
    FlagField("--fp4-format", "training.fp4", convert=_as_given),
    FlagField("--fp4-recipe", "training.fp4_recipe", convert=_as_given),
    FlagField("--fp4-param-gather", None, None, "FP4 parameters (all-gathered in FP4)", _as_given),
    FlagField("--decoder-first-pipeline-num-layers", "parallel.decoder_first_pipeline_num_layers"),
    FlagField("--decoder-last-pipeline-num-layers", "parallel.decoder_last_pipeline_num_layers"),
    FlagField("--pipeline-model-parallel-layout", "parallel.pipeline_layout", convert=_layout),
    FlagField("--mtp-num-layers", "model.mtp_num_layers"),
    FlagField("--account-for-embedding-in-pipeline-split", "parallel.account_for_embedding_in_pipeline_split",
              convert=_as_given),
    FlagField("--account-for-loss-in-pipeline-split", "parallel.account_for_loss_in_pipeline_split",
              convert=_as_given),
    FlagField("--heterogeneous-layers-config-path", None, None, "heterogeneous layers", _as_given),
    FlagField("--heterogeneous-layers-config-encoded-json", None, None, "heterogeneous layers", _as_given),
    FlagField("--fp8-param-gather", "training.fp8_param_gather", convert=_as_given),
    FlagField("--cross-entropy-loss-fusion", "training.cross_entropy_fusion", convert=_as_given),
    FlagField("--defer-embedding-wgrad-compute", "training.defer_embedding_wgrad", convert=_as_given),
    FlagField("--wgrad-deferral-limit", "training.wgrad_deferral_limit", convert=non_negative_int),
    # Checked only: their accepted values convert to the inactive one, the others are refused in convert.
    FlagField("--cross-entropy-fusion-impl", None, "native", "", _cross_entropy_impl),
    FlagField("--attention-backend", "training.unfused_attention", convert=_attention_backend),
    FlagField("--spec", None, None, "a custom layer spec", _as_given),
    FlagField("--disable-tp-comm-overlap-ag", None, None, "TP overlap without its all-gather overlap", _as_given),
    FlagField("--disable-tp-comm-overlap-rs", None, None, "TP overlap without its reduce-scatter overlap", _as_given),
    FlagField("--microbatch-group-size-per-virtual-pipeline-stage", "training.microbatch_group_size"),
    FlagField("--ddp-num-buckets", None, None, "a DDP bucket count (--ddp-bucket-size is modelled)"),
    FlagField("--use-tp-pp-dp-mapping", "parallel.tp_pp_dp_mapping", convert=_as_given),
    FlagField("--use-sharp", None, None, "in-network (SHARP) reductions", _as_given),
    FlagField("--enable-cuda-graph", "training.cuda_graph_impl", convert=_graph_impl("local")),
    FlagField("--external-cuda-graph", "training.cuda_graph_impl", convert=_graph_impl("transformer_engine")),
    FlagField("--cuda-graph-impl", "training.cuda_graph_impl", convert=_graph_impl_named),
    FlagField("--cuda-graph-scope", "training.cuda_graph_scope", convert=_graph_scopes),
    FlagField("--cuda-graph-modules", "training.cuda_graph_scope", convert=_graph_scopes),  # the scope's new name
    FlagField("--cuda-graph-warmup-steps", "training.cuda_graph_warmup_steps", convert=non_negative_int),
    FlagField("--deterministic-mode", "training.deterministic", convert=_as_given),
    FlagField("--no-gradient-accumulation-fusion", "training.gradient_accumulation_fusion", convert=_negated),
    FlagField("--log-params-norm", "training.log_params_norm", convert=_as_given),
    FlagField("--log-num-zeros-in-grad", "training.log_num_zeros_in_grad", convert=_as_given),
    FlagField("--no-check-for-nan-in-loss-and-grad", "training.nan_checks", convert=_negated),
    FlagField("--calculate-per-token-loss", "training.per_token_loss", convert=_as_given),
    FlagField("--manual-gc", "training.manual_gc", convert=_as_given),
    FlagField("--manual-gc-interval", "training.manual_gc_interval", convert=non_negative_int),
    FlagField("--distribute-saved-activations", None, None, "recompute inputs distributed over TP", _as_given),
    FlagField("--fp16-lm-cross-entropy", None, None, "a cross-entropy on fp16 logits", _as_given),
    FlagField("--use-precision-aware-optimizer", "optimizer.precision_aware", convert=_as_given),
    FlagField("--main-grads-dtype", "optimizer.main_grads", convert=_state_dtype),
    FlagField("--main-params-dtype", "optimizer.main_params", convert=_state_dtype),
    FlagField("--exp-avg-dtype", "optimizer.exp_avg", convert=_state_dtype),
    FlagField("--exp-avg-sq-dtype", "optimizer.exp_avg_sq", convert=_state_dtype),
    *(FlagField(feature.flag, None, None, feature.what, _as_given) for feature in REFUSED),
)
_FIELD_OF = {row.flag: row for row in FIELDS}


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronPlan:
    """The specs a Megatron-LM command line describes, and what it gives that vtrain does not model."""

    model: ModelSpec
    parallel: ParallelPlan
    training: TrainingSpec
    unmodelled: tuple[str, ...] = ()  # flags (with values) and notes, for one warning line
    stack_reason: str = ""  # which flag chose training.software_stack (software_stack)
    assumed: tuple[str, ...] = ()  # what vtrain chose where the command line is silent or overridden

    @property
    def warning(self) -> str | None:
        if not self.unmodelled:
            return None
        return unmodelled_warning("Megatron-LM arguments", self.unmodelled)

    @property
    def note(self) -> str | None:
        return "; ".join(self.assumed) or None


def megatron_plan(command: LaunchCommand, *, gpus: int | None = None) -> MegatronPlan:
    """The specs of a Megatron-LM command line on ``command.num_gpus(gpus)`` GPUs (see the module doc);
    a ``gpus`` that overrides the script's count, and sizes vtrain assumed, are in ``assumed``."""
    _refuse_entry_point(command.script)
    given = parse_flags(command.megatron_args)
    stack, stack_reason = software_stack(given)
    values: dict[str, dict[str, Any]] = {"model": {}, "parallel": {}, "training": {"software_stack": stack},
                                         "optimizer": {}}
    for flag, value in given.items():
        if flag in UNSUPPORTED_FLAGS:
            raise _unsupported(_shown(flag, value), UNSUPPORTED_FLAGS[flag])
        row = _FIELD_OF.get(flag)
        if row is None and TABLE[flag].effect is Effect.REFUSED and not TABLE[flag].at_default(value):
            raise ConfigError(f"{_shown(flag, value)}: {TABLE[flag].reason} is not modelled by vtrain yet")
        if row is None or flag in consumed_by_attention(given):
            continue
        converted = row.convert(flag, value)
        if row.field is None and converted != row.inactive:
            raise ConfigError(f"{_shown(flag, value)}: {row.what} is not modelled by vtrain yet")
        if row.field is not None:
            section, name = row.field.split(".")
            values[section][name] = converted
    if "micro_batch_size" not in values["parallel"]:
        raise ConfigError("--micro-batch-size is required")
    notes = [_shown(flag, given[flag]) for flag in given if flag in PERFORMANCE_FLAGS]
    num_gpus, override = command.num_gpus(gpus)
    assumed = [override] if override else []
    tp = values["parallel"].setdefault("tensor_parallel", 1)
    values["parallel"].setdefault("pipeline_parallel", 1)
    values["model"].update(hybrid_fields(command.script, given, values["model"]))  # pretrain_mamba.py
    values["model"].update(model_fields(given, values["model"], tensor_parallel=tp, notes=notes, assumed=assumed))
    model = ModelSpec(**values["model"])
    parallel = _parallel(given, values["parallel"], model, num_gpus, notes)
    values["training"]["optimizer"] = OptimizerSpec(**values["optimizer"])
    values["training"]["activation_offload"] = offload_args.activation_offload(given, notes)
    training = _training(given, values["training"], model, parallel, stack_reason, assumed)
    return MegatronPlan(model=model, parallel=parallel, training=training, unmodelled=tuple(notes),
                        stack_reason=stack_reason, assumed=tuple(assumed))


def _refuse_entry_point(script: str) -> None:
    """Megatron-LM's training scripts for other models than a GPT decoder or a Mamba hybrid
    (pretrain_mamba.py, :mod:`vtrain_plugin.specs.megatron.hybrid_args`) are refused by name."""
    name = PurePosixPath(script).name
    for stem, what in UNSUPPORTED_SCRIPTS.items():
        if name.startswith(stem):
            raise _unsupported(name, what)


def _unsupported(name: str, what: str) -> ConfigError:
    return ConfigError(f"{name}: {what} are not supported by vtrain (it estimates GPT decoders, Megatron-LM's "
                       f"pretrain_gpt.py)")


def script_plan(commands: Sequence[LaunchCommand], *, gpus: int | None = None) -> MegatronPlan:
    """The plan of a launch script read as one or more command lines (one per way the blocks it
    depends on may run, :func:`vtrain_plugin.specs.megatron.launch_script.read_launch_script`): they must all
    give the same plan, or fail the same way."""
    outcomes: list[MegatronPlan | ConfigError] = []
    for command in commands:
        try:
            outcomes.append(megatron_plan(command, gpus=gpus))
        except ConfigError as exc:
            outcomes.append(exc)
    first = outcomes[0]
    if isinstance(first, ConfigError):
        if all(isinstance(o, ConfigError) and str(o) == str(first) for o in outcomes):
            raise first
    elif all(isinstance(o, MegatronPlan) and (o.model, o.parallel, o.training) ==
             (first.model, first.parallel, first.training) for o in outcomes):
        plans = [o for o in outcomes if isinstance(o, MegatronPlan)]
        return replace(first, unmodelled=tuple(dict.fromkeys(n for o in plans for n in o.unmodelled)),
                       assumed=tuple(dict.fromkeys(n for o in plans for n in o.assumed)))
    command = commands[0]
    raise ConfigError(
        f"line {command.line}: the plan depends on whether the if/for/while/case blocks at line"
        f"{'s' if len(command.blocks) > 1 else ''} {', '.join(map(str, command.blocks))} run, which set variables "
        f"the training command reads; vtrain reads the script without running it, so write those flags outside "
        f"the blocks")


def _parallel(given: Given, values: dict[str, Any], model: ModelSpec, num_gpus: int, notes: list[str]
              ) -> ParallelPlan:
    tp, pp = values["tensor_parallel"], values["pipeline_parallel"]
    if not model.is_moe and "expert_tensor_parallel" in values:  # no experts: Megatron-LM ignores it
        notes.append(f"--expert-tensor-parallel-size {values.pop('expert_tensor_parallel')} without experts "
                     f"(Megatron-LM ignores it)")
    cp = positive_int("--context-parallel-size", given.get("--context-parallel-size", 1))
    model_parallel = tp * pp * cp
    if num_gpus % model_parallel:
        raise ConfigError(
            f"GPUs ({num_gpus}) must be a multiple of --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {model_parallel}: "
            f"data parallel size = {num_gpus} / {model_parallel} = {num_gpus / model_parallel:g}")
    values["data_parallel"] = num_gpus // model_parallel
    values["virtual_pipeline"] = _virtual_pipeline(given, model.num_layers, pp)
    if given.get("--sequence-parallel"):
        values["sequence_parallel"] = tp > 1
        if tp == 1:
            notes.append("--sequence-parallel at TP 1 (Megatron-LM turns it off)")
    values["recompute"] = recompute_mode(given, model.num_layers, pp * values["virtual_pipeline"])
    values["recompute_modules"] = recompute_modules(given, values["recompute"], notes)
    if model.is_moe:  # Megatron-LM's default dispatcher
        values.setdefault("moe_token_dispatcher", TokenDispatcher.ALLGATHER)
        values.update(flex_dispatcher_fields(given))
    return ParallelPlan(**values)


def _split_slots(given: Given) -> int:
    """Layer slots the embedding and the loss take in the pipeline split (0, 1 or 2)."""
    return sum(bool(given.get(flag)) for flag in ("--account-for-embedding-in-pipeline-split",
                                                  "--account-for-loss-in-pipeline-split"))


def _virtual_pipeline(given: Given, num_layers: int, pp: int) -> int:
    """Virtual stages per pipeline rank; the embedding and the loss count as layers when they are in
    the split (``--account-for-embedding/loss-in-pipeline-split``), as in Megatron-LM."""
    per_stage_flag, per_rank_flag = "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"
    if "--pipeline-model-parallel-layout" in given:  # Megatron-LM takes the virtual stages from the layout
        given_too = [f for f in (per_stage_flag, per_rank_flag) if f in given]
        if given_too:
            raise ConfigError(f"--pipeline-model-parallel-layout with {given_too[0]}: the layout gives the virtual "
                              f"stages")
        return max(1, len(layout_stages(_layout("", given["--pipeline-model-parallel-layout"]))) // pp)
    if per_stage_flag in given and per_rank_flag in given:
        raise ConfigError(f"give {per_stage_flag} or {per_rank_flag}, not both")
    if per_rank_flag in given:
        return positive_int(per_rank_flag, given[per_rank_flag])
    if per_stage_flag not in given:
        return 1
    uneven = [f for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers") if f in given]
    if uneven:
        raise ConfigError(f"{per_stage_flag} with {uneven[0]}: give the virtual stages as {per_rank_flag}")
    per_chunk = positive_int(per_stage_flag, given[per_stage_flag])
    slots = _split_slots(given)
    shown = f"--num-layers ({num_layers}) + {slots} (embedding / loss)" if slots else f"--num-layers ({num_layers})"
    num_layers += slots
    if num_layers % pp or (num_layers // pp) % per_chunk:
        raise ConfigError(
            f"{shown} / --pipeline-model-parallel-size ({pp}) = {num_layers / pp:g} layers "
            f"per stage must be a multiple of {per_stage_flag} ({per_chunk})")
    return num_layers // pp // per_chunk


def _training(given: Given, values: dict[str, Any], model: ModelSpec, parallel: ParallelPlan, stack: str,
              assumed: list[str]) -> TrainingSpec:
    """Megatron-LM's defaults: global batch = micro-batch x data parallel; DDP buckets of
    max(4e7, 1e6 x data parallel) parameters (in the run's gradient dtype) when gradient reduction
    overlaps backward. ``stack`` is why the software stack is the one in ``values``
    (:func:`software_stack`)."""
    values.setdefault("global_batch_size", parallel.micro_batch_size * parallel.data_parallel)
    values["schedule"] = ScheduleKind.INTERLEAVED_1F1B if parallel.virtual_pipeline > 1 else ScheduleKind.ONE_F_ONE_B
    if values["schedule"] is not ScheduleKind.INTERLEAVED_1F1B:  # megatron-core reads the groups only when interleaving
        values.pop("microbatch_group_size", None)
    if values["software_stack"] is not SoftwareStack.MEGATRON_CORE_TE and "fp8" in values:
        flag = stack.partition(":")[0]
        raise ConfigError(f"--fp8-format with {flag}: Megatron-LM runs FP8 through TransformerEngine only")
    # Megatron-LM reduces a bf16 model's gradients in fp32 unless --grad-reduce-in-bf16; an fp16 or
    # fp32 model's stay in the model dtype either way.
    values["grad_reduce_in_bf16"] = bool(given.get("--grad-reduce-in-bf16")) and model.dtype is Dtype.BF16
    if given.get("--accumulate-allreduce-grads-in-fp32") and model.dtype is Dtype.FP16:
        raise ConfigError("--accumulate-allreduce-grads-in-fp32 with --fp16: fp32 gradients of an fp16 model are "
                          "not modelled by vtrain yet")
    values.update(_fp8_bf16_edge_layers(given, fp8="fp8" in values))
    if values.get("tp_comm_overlap") and parallel.tensor_parallel == 1:  # no TP communication to overlap
        values["tp_comm_overlap"] = False
        assumed.append("--tp-comm-overlap at TP 1: no tensor-parallel communication to overlap, so it changes "
                       "nothing (Megatron-Bridge turns it off below TP 2)")
    if given.get("--overlap-param-gather") and not given.get("--overlap-grad-reduce"):
        # megatron-core (and Megatron-Bridge, whose recipes set it so) overlaps the gather alone
        assumed.append("--overlap-param-gather without --overlap-grad-reduce, which Megatron-LM's own argument "
                       "check refuses: estimated as megatron-core runs it (gradients reduced after backward)")
    if given.get("--cuda-graph-impl") == "full_iteration":
        values["cuda_graph_scope"] = ("full_iteration",)
    values["reliability"] = _reliability(given)
    values["unfused_kernels"] = unfused_kernels(given)
    values["fsdp"] = fsdp_settings(given)
    if given.get("--deterministic-mode") and given.get("--cross-entropy-loss-fusion"):
        raise ConfigError("--deterministic-mode with --cross-entropy-loss-fusion: Megatron-LM refuses them together "
                          "(the fused cross-entropy is not deterministic)")
    if given.get("--overlap-grad-reduce"):
        values["grad_reduce"] = GradReduce.OVERLAP
    training = TrainingSpec(**values)
    if not given.get("--overlap-grad-reduce"):
        return training
    flag = "--ddp-bucket-size"
    grad_nbytes = training.grad_dtype(model.dtype).nbytes
    if flag not in given:
        return replace(training, bucket_size_mb=default_bucket_size_mb(parallel.data_parallel, grad_nbytes))
    return replace(training, bucket_size_mb=positive_int(flag, given[flag]) * grad_nbytes / 1e6)


def _fp8_bf16_edge_layers(given: Given, *, fp8: bool) -> dict[str, int]:
    """``--first-last-layers-bf16``: the first ``--num-layers-at-start-in-bf16`` and last
    ``--num-layers-at-end-in-bf16`` layers (1 each by default) outside FP8; without FP8 the flags
    change nothing."""
    if not (fp8 and given.get("--first-last-layers-bf16")):
        return {}
    return {"fp8_bf16_layers_at_start": non_negative_int("--num-layers-at-start-in-bf16",
                                                         given.get("--num-layers-at-start-in-bf16", 1)),
            "fp8_bf16_layers_at_end": non_negative_int("--num-layers-at-end-in-bf16",
                                                       given.get("--num-layers-at-end-in-bf16", 1))}


def software_stack(given: Given) -> tuple[SoftwareStack, str]:
    """The kernels a Megatron-LM (0.16) command line runs, and why:

    - by default (``--transformer-impl transformer_engine``) megatron-core's TransformerEngine
      layers, whatever the GPU and dtype: ``megatron_core_te``;
    - ``--transformer-impl local``: megatron-core's local layer spec, which runs Megatron's own fused
      kernels (scaled masked softmax, bias-GeLU, bias-dropout-add, apex or persistent LayerNorm)
      around unfused attention and megatron-core's fused Adam, with megatron-core's host work:
      ``megatron_core_local``;
    - ``--use-legacy-models``: the legacy Megatron GPT, the model of Megatron-DeepSpeed:
      ``megatron_deepspeed_2023``.
    """
    if given.get("--use-legacy-models"):
        return SoftwareStack.MEGATRON_DEEPSPEED_2023, "--use-legacy-models: the legacy Megatron GPT's fused kernels"
    impl = given.get("--transformer-impl", "transformer_engine")
    if impl == "transformer_engine":
        return SoftwareStack.MEGATRON_CORE_TE, "--transformer-impl transformer_engine (Megatron-LM's default)"
    if impl == "local":
        return (SoftwareStack.MEGATRON_CORE_LOCAL,
                "--transformer-impl local: megatron-core's local layers run Megatron's fused kernels")
    if impl == "inference_optimized":
        raise ConfigError("--transformer-impl inference_optimized: inference layers are not supported by vtrain "
                          "(it estimates training)")
    raise ConfigError(f"--transformer-impl must be transformer_engine, local or inference_optimized, got {impl!r}")


def _reliability(given: Given) -> ReliabilitySpec:
    """The checkpointing of the command line: ``--save-interval`` and ``--async-save`` (with
    ``--save``: without a directory Megatron-LM saves nothing, and the interval is chosen)."""
    if "--save" not in given:
        return ReliabilitySpec()
    interval = given.get("--save-interval")
    return ReliabilitySpec(
        checkpoint=CheckpointMode.ASYNC if given.get("--async-save") else CheckpointMode.SYNC,
        checkpoint_interval_iterations=None if interval is None else positive_int("--save-interval", interval))


def _shown(flag: str, value: Any) -> str:
    if value is True:
        return flag
    return f"{flag} {' '.join(value) if isinstance(value, list) else value}".rstrip()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"Megatron-LM arguments: {message}")


@lru_cache(maxsize=1)
def _parser() -> _Parser:
    parser = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for flag, arity in MEGATRON_FLAGS.items():
        if arity is Arity.SWITCH:
            parser.add_argument(flag, dest=flag, action="store_true", default=None)
        else:
            parser.add_argument(flag, dest=flag, nargs="*" if arity is Arity.LIST else None)
    return parser


def _inline_list(value: Any) -> Any:
    """A list value written as a YAML list on one line (``[a, b]`` or ``'[a' b 'c]'``, as test
    harnesses render Megatron-LM's YAML arguments): its items."""
    if not (isinstance(value, list) and value and value[0].startswith("[") and value[-1].endswith("]")):
        return value
    words = " ".join(value)[1:-1].replace(",", " ").split()
    return words


def parse_flags(argv: Sequence[str]) -> dict[str, Any]:
    """The Megatron-LM flags ``argv`` gives (flag -> value, list of values, or True); a word that is not
    a Megatron-LM argument is refused, naming the closest one."""
    namespace, extra = _parser().parse_known_args(list(argv))
    if extra:
        word = next((w for w in extra if w.startswith("-")), extra[0])
        if not word.startswith("-"):
            raise ConfigError(f"unexpected word {word!r}: not the value of a Megatron-LM flag")
        flag = word.partition("=")[0]
        close = difflib.get_close_matches(flag, MEGATRON_FLAGS, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        scanned = releases()
        raise ConfigError(f"unknown argument {flag}: no Megatron-LM release from {scanned[0]} to {scanned[-1]} has "
                          f"it{hint}")
    parsed = {ALIASES.get(flag, flag): _inline_list(value) for flag, value in vars(namespace).items()
              if value is not None}
    order = [ALIASES.get(word.partition("=")[0], word.partition("=")[0]) for word in argv if word.startswith("--")]
    given = {flag: parsed[flag] for flag in dict.fromkeys(order) if flag in parsed}  # in command-line order
    for flag, replacement in RETIRED_FLAGS.items():
        if flag in given:
            raise ConfigError(f"{flag} is retired in Megatron-LM; use {replacement}")
    return given

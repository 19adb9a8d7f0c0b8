"""A Megatron-Bridge / NeMo 2 ``ConfigContainer`` (the YAML ``to_yaml()`` writes, a checkpoint's
``run_config.yaml``, or an override file) as the Megatron-LM command line it describes.

Each field is the Megatron-LM argument of the same ``dest`` (TransformerConfig, DDP and optimizer
fields are named as Megatron-LM's argument destinations; :data:`DEST_FLAGS` lists the few whose flag
is spelt otherwise, :data:`RENAMED` the TransformerConfig names Megatron-LM's arguments do not use),
so the plan is read by :func:`vtrain_plugin.specs.megatron.args.megatron_plan`, flag table and all:
a Bridge recipe and the same run's launch script give the same estimate, and what is modelled,
accepted or refused is decided in one place. A field at megatron-core's default
(``data/megatron_core_defaults.json``) counts as not given. In ``model``, ``ddp``, ``optimizer``,
``mixed_precision``, ``dist`` and ``comm_overlap`` a field that is neither a Megatron-LM argument nor
at its default may change time or memory and is refused by name; the other sections (``logger``,
``checkpoint``, ``dataset``, ``tokenizer``, ``rng``, ``scheduler``...) change nothing vtrain predicts
but what maps onto a Megatron-LM argument (checkpoint interval, batch sizes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.flags import MEGATRON_FLAGS, Arity
from vtrain_plugin.specs.megatron.launch_script import LaunchCommand

# ConfigContainer's sections (megatron-bridge 0.3.1, training/config.py).
SECTIONS = ("rng", "rerun_state_machine", "train", "model", "optimizer", "optimizer_config_override_provider", "ddp",
            "validation", "scheduler", "dataset", "logger", "tokenizer", "checkpoint", "dist", "ft", "straggler",
            "nvrx_straggler", "profiling", "peft", "comm_overlap", "mixed_precision", "tensor_inspect",
            "inprocess_restart", "env_vars")
# Sections whose fields shape compute, memory or communication: an unmapped field away from its
# default is refused.
SHAPING_SECTIONS = ("model", "ddp", "optimizer", "mixed_precision", "dist", "comm_overlap")
# Sections read as Megatron-LM arguments: those above, the batch sizes, and the checkpoint interval.
# The others change nothing vtrain predicts (the tokenizer's vocabulary is the model's vocab_size).
READ_SECTIONS = ("train", *SHAPING_SECTIONS)
CHECKPOINT_FIELDS = ("save", "save_interval", "async_save")

# Megatron-LM arguments whose dest is not the flag's name (flags_by_release.csv, `dest` column): dest
# -> (flag, store_false: the switch is given when the field is false).
DEST_FLAGS: dict[str, tuple[str, bool]] = {
    "add_bias_linear": ("--disable-bias-linear", True),
    "add_position_embedding": ("--no-position-embedding", True),
    "align_grad_reduce": ("--no-align-grad-reduce", True),
    "align_param_gather": ("--no-align-param-gather", True),
    "apply_rope_fusion": ("--no-rope-fusion", True),
    "async_tensor_model_parallel_allreduce": ("--no-async-tensor-model-parallel-allreduce", True),
    "bias_dropout_fusion": ("--no-bias-dropout-fusion", True),
    "bias_gelu_fusion": ("--no-bias-gelu-fusion", True),
    "bias_swiglu_fusion": ("--no-bias-swiglu-fusion", True),
    "check_for_nan_in_loss_and_grad": ("--no-check-for-nan-in-loss-and-grad", True),
    # DistributedDataParallelConfig's gradient check, which Megatron-LM sets from the same flag as the
    # loss's (training.nan_checks is both; Bridge's loss check, rerun_state_machine.check_for_nan_in_loss,
    # is taken to follow it)
    "check_for_nan_in_grad": ("--no-check-for-nan-in-loss-and-grad", True),
    "ckpt_fully_parallel_save": ("--no-ckpt-fully-parallel-save", True),
    "clone_scatter_output_in_embedding": ("--no-clone-scatter-output-in-embedding", True),
    "create_attention_mask_in_dataloader": ("--no-create-attention-mask-in-dataloader", True),
    "fp4": ("--fp4-format", False),
    "fp8": ("--fp8-format", False),
    "fp8_wgrad": ("--no-fp8-wgrad", True),
    "gradient_accumulation_fusion": ("--no-gradient-accumulation-fusion", True),
    "layernorm_epsilon": ("--norm-epsilon", False),
    "layernorm_zero_centered_gamma": ("--apply-layernorm-1p", False),
    "manual_gc_eval": ("--no-manual-gc-eval", True),
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", True),
    "microbatch_group_size_per_vp_stage": ("--microbatch-group-size-per-virtual-pipeline-stage", False),
    "mmap_bin_files": ("--no-mmap-bin-files", True),
    "nccl_ub": ("--use-nccl-ub", False),
    "overlap_p2p_comm": ("--no-overlap-p2p-communication", True),
    "overlap_p2p_comm_warmup_flush": ("--overlap-p2p-communication-warmup-flush", False),
    "perform_initialization": ("--no-initialization", True),
    "scatter_gather_tensors_in_pipeline": ("--no-scatter-gather-tensors-in-pipeline", True),
    "torch_fsdp2_reshard_after_forward": ("--torch-fsdp2-no-reshard-after-forward", True),
    "tp_comm_bulk_dgrad": ("--disable-tp-comm-bulk-dgrad", True),
    "tp_comm_bulk_wgrad": ("--disable-tp-comm-bulk-wgrad", True),
    "tp_comm_overlap_ag": ("--disable-tp-comm-overlap-ag", True),
    "tp_comm_overlap_rs": ("--disable-tp-comm-overlap-rs", True),
    "tp_comm_split_ag": ("--disable-tp-comm-split-ag", True),
    "tp_comm_split_rs": ("--disable-tp-comm-split-rs", True),
    "use_gloo_process_groups": ("--disable-gloo-process-groups", True),
    "use_mamba_mem_eff_path": ("--disable-mamba-mem-eff-path", True),
    # TransformerConfig's names of Megatron-LM arguments (megatron/training/arguments.py,
    # core_transformer_config_from_args, renames them)
    "num_moe_experts": ("--num-experts", False),
    "virtual_pipeline_model_parallel_size": ("--num-virtual-stages-per-pipeline-rank", False),
    "num_layers_in_first_pipeline_stage": ("--decoder-first-pipeline-num-layers", False),
    "num_layers_in_last_pipeline_stage": ("--decoder-last-pipeline-num-layers", False),
    "ddp_bucket_size": ("--ddp-bucket-size", False),
    "bucket_size": ("--ddp-bucket-size", False),
    "average_in_collective": ("--ddp-average-in-collective", False),
    # DistributedDataParallelConfig's gradient dtype: Megatron-LM reduces a bf16 model's gradients in
    # fp32 unless --grad-reduce-in-bf16
    "grad_reduce_in_fp32": ("--grad-reduce-in-bf16", True),
}
# Fields that change nothing vtrain predicts, or that another field decides (the dtypes follow bf16
# / fp16; the activation and GQA are read together in :func:`_model_words`): accepted as given.
NO_EFFECT = frozenset((
    "params_dtype", "pipeline_dtype", "autocast_dtype", "autocast_enabled", "fp32", "init_method",
    "output_layer_init_method", "embedding_init_method", "timers", "finalize_model_grads_func", "grad_scale_func",
    "no_sync_func", "grad_sync_func", "param_sync_func", "generation_config", "hf_model_id", "use_cpu_initialization",
    "gated_linear_unit", "activation_func", "num_query_groups", "share_embeddings_and_output_weights",
    "should_pad_vocab", "parallel_output", "use_transformer_engine_full_layer_spec",
    "use_transformer_engine_op_fuser", "variable_seq_lengths", "deallocate_pipeline_outputs", "barrier_with_L1_time",
    "check_for_large_grads", "data_parallel_size", "lr", "min_lr", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad", "loss_scale", "initial_loss_scale",
    "min_loss_scale", "loss_scale_window", "hysteresis", "fp8_margin", "fp8_amax_history_len",
    "fp8_amax_compute_algo", "fp8_interval", "use_te_rng_tracker",
))
# GPTModelProvider's own fields at their defaults (megatron-bridge 0.3.1, models/gpt_provider.py) where
# they are not TransformerConfig's or differ from it.
PROVIDER_DEFAULTS = {"scatter_embedding_sequence_parallel": True, "tp_only_amax_red": False, "rope_scaling": False,
                     "mtp_enabled": False, "restore_modelopt_state": False, "use_arbitrary_attention_mask": None,
                     "tp_comm_overlap_cfg": None}
LAYER_SPEC_DEFAULT = "default_layer_spec"  # GPTModelProvider's transformer_layer_spec (a function of the config)

# Megatron-Bridge's mixed-precision recipes by name (megatron-bridge 0.3.1, training/mixed_precision.py):
# the MixedPrecisionConfig fields each sets.
_BF16 = {"bf16": True, "grad_reduce_in_fp32": True}
_FP16 = {"fp16": True, "grad_reduce_in_fp32": False}
_CURRENT = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1,
            "num_layers_at_end_in_bf16": 1, "fp8_param_gather": True}
_RECIPES: dict[str, dict[str, Any]] = {
    "bf16_mixed": _BF16, "fp16_mixed": _FP16,
    **{f"{base}_with_fp8_delayed_scaling_mixed": {**dtype, "fp8": "hybrid", "fp8_recipe": "delayed",
                                                  "fp8_param_gather": True}
       for base, dtype in (("bf16", _BF16), ("fp16", _FP16))},
    **{f"{base}_with_mxfp8_mixed": {**dtype, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True,
                                    "reuse_grad_buf_for_mxfp8_param_ag": True}
       for base, dtype in (("bf16", _BF16), ("fp16", _FP16))},
    **{f"{base}_with_fp8_current_scaling_mixed": {**dtype, **_CURRENT} for base, dtype in (("bf16", _BF16),
                                                                                          ("fp16", _FP16))},
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT, "num_layers_at_start_in_bf16": 2,
                                                       "num_layers_at_end_in_bf16": 2},
    "nanov2_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT, "fp8_recipe": "blockwise",
                                                   "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 2},
    **{f"{base}_with_fp8_subchannel_scaling_mixed": {**dtype, "fp8": "hybrid", "fp8_recipe": "blockwise"}
       for base, dtype in (("bf16", _BF16), ("fp16", _FP16))},
    "bf16_with_nvfp4_mixed": {**_BF16, "fp4": "nvfp4", "fp4_recipe": "nvfp4"},
}
MIXED_PRECISION_RECIPES = {**_RECIPES, **{name.replace("_", "-"): fields for name, fields in _RECIPES.items()}}


def bridge_command(data: Mapping[str, Any]) -> LaunchCommand:
    """The Megatron-LM command line (``pretrain_gpt.py``'s flags) a ConfigContainer mapping describes."""
    v.no_unknown_keys("ConfigContainer", data, (*SECTIONS, "_target_"))
    sections = {name: _fields(name, data.get(name)) for name in SECTIONS}
    _check_sequence_length(sections)
    words: list[str] = []
    model = dict(sections["model"])
    words += _model_words(model)
    precision = _precision(data.get("mixed_precision"))
    if data.get("peft") is not None:
        raise ConfigError("peft: fine-tuning adapters (LoRA) are not modelled by vtrain yet")
    if model.get("vocab_size") is None:
        raise ConfigError("model.vocab_size is missing: the model provider's vocabulary size")
    for name in READ_SECTIONS:
        fields = precision if name == "mixed_precision" else model if name == "model" else sections[name]
        for key, value in fields.items():
            words += _words(name, key, value)
    for key in CHECKPOINT_FIELDS:
        words += _words("checkpoint", key, sections["checkpoint"].get(key))
    return LaunchCommand(megatron_args=tuple(words), script="pretrain_gpt.py")


def _fields(section: str, value: Any) -> dict[str, Any]:
    """A section's fields, ``_target_`` left out; a section that is null or absent has none."""
    if value is None or section == "mixed_precision" and isinstance(value, str):
        return {}
    fields = dict(v.mapping(section, value))
    fields.pop("_target_", None)
    return fields


def _precision(value: Any) -> dict[str, Any]:
    """The mixed_precision section: a recipe name, or the MixedPrecisionConfig fields."""
    if value is None:
        return {}
    if isinstance(value, str):
        if value not in MIXED_PRECISION_RECIPES:
            raise ConfigError(f"mixed_precision: unknown recipe {value!r}; known recipes are "
                              f"{', '.join(_RECIPES)}")
        return dict(MIXED_PRECISION_RECIPES[value])
    fields = _fields("mixed_precision", value)
    if fields.get("fp8") is None:  # fp8_recipe has a default even without fp8
        fields.pop("fp8_recipe", None)
    if fields.get("fp4") is None:
        fields.pop("fp4_recipe", None)
    return fields


def _check_sequence_length(sections: Mapping[str, Mapping[str, Any]]) -> None:
    model, dataset = sections["model"].get("seq_length"), sections["dataset"].get("seq_length")
    if model is not None and dataset is not None and model != dataset:
        raise ConfigError(f"dataset.seq_length ({dataset}) must equal model.seq_length ({model})")
    if model is None and dataset is not None:
        raise ConfigError("model.seq_length is missing (dataset.seq_length is given): give both")


def _model_words(model: dict[str, Any]) -> list[str]:
    """The model fields that are read together: the activation and its bias fusion, grouped-query
    attention, tied embeddings and the layer spec (popped from ``model``)."""
    words: list[str] = []
    activation = _plain(model.pop("activation_func", None)) or ""
    gated = bool(model.pop("gated_linear_unit", False))
    name = activation.rpartition(".")[2]
    swiglu = gated and name == "silu"
    if swiglu:
        words.append("--swiglu")
    elif name == "squared_relu" and not gated:
        words.append("--squared-relu")
    elif activation and not (name == "gelu" and not gated):
        raise ConfigError(f"model.activation_func {activation}{' (gated)' if gated else ''}: only gelu, "
                          f"squared_relu and a gated silu (SwiGLU) are Megatron-LM arguments vtrain reads")
    # Megatron-LM sets bias_activation_fusion from --no-bias-swiglu-fusion with --swiglu, from
    # --no-bias-gelu-fusion otherwise (vtrain_plugin.specs.megatron.fusion_flags)
    if model.pop("bias_activation_fusion", None) is False:
        words.append("--no-bias-swiglu-fusion" if swiglu else "--no-bias-gelu-fusion")
    groups = model.pop("num_query_groups", None)
    if groups is not None and groups != model.get("num_attention_heads"):
        words += ["--group-query-attention", "--num-query-groups", str(groups)]
    if model.pop("share_embeddings_and_output_weights", True) is False:
        words.append("--untie-embeddings-and-output-weights")
    if model.get("fp8") is None:  # fp8_recipe has a default even without fp8
        model.pop("fp8_recipe", None)
    spec = _plain(model.pop("transformer_layer_spec", None))
    if spec is not None and not str(spec).endswith(LAYER_SPEC_DEFAULT):
        raise ConfigError(f"model.transformer_layer_spec {spec}: a custom layer spec is not modelled by vtrain yet")
    return words


def _plain(value: Any) -> Any:
    """A value as to_yaml() writes it, read back: a function or dtype (``_target_`` with ``_call_:
    false``) as its name, an enum as its value."""
    if isinstance(value, Mapping) and "_target_" in value:
        if value.get("_call_", True) is False:
            return value["_target_"]
        if "_args_" in value and len(value["_args_"]) == 1:
            return value["_args_"][0]
    return value


def _words(section: str, key: str, given: Any) -> list[str]:
    """The Megatron-LM words of one field (see the module doc)."""
    value = _plain(given)
    default = _defaults().get(section, {}).get(key, _ABSENT)
    if section == "model":
        default = PROVIDER_DEFAULTS.get(key, default)
    at_default = key not in DEST_FLAGS and (value == default or (default is _ABSENT and value in (None, False)))
    if at_default or key in NO_EFFECT:
        return []
    flag, store_false = DEST_FLAGS.get(key, ("--" + key.replace("_", "-"), False))
    arity = MEGATRON_FLAGS.get(flag)
    if arity is None:
        if section in SHAPING_SECTIONS:
            raise ConfigError(f"{section}.{key} {_shown(value)}: not a setting vtrain reads (it may change speed or "
                              f"memory); leave it at its default")
        return []
    if arity is Arity.SWITCH:
        if not isinstance(value, bool):
            raise ConfigError(f"{section}.{key} must be true or false, got {_shown(value)}")
        return [flag] if value != store_false else []
    if value is None:
        return []
    if isinstance(value, Mapping):
        raise ConfigError(f"{section}.{key}: expected a value, got a mapping")
    if arity is Arity.LIST:
        return [flag, *map(str, value if isinstance(value, list) else [value])]
    if isinstance(value, (list, bool)):
        raise ConfigError(f"{section}.{key} must be one value, got {_shown(value)}")
    return [flag, str(value)]


_ABSENT = object()


def _shown(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


@lru_cache(maxsize=1)
def _defaults() -> dict[str, dict[str, Any]]:
    path = resources.files("vtrain_plugin.specs.megatron").joinpath("data", "megatron_core_defaults.json")
    return json.loads(path.read_text())

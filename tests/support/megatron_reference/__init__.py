"""Megatron-LM's own FLOP and memory accounting, loaded from the verbatim copies beside this file.

``num_floating_point_operations`` and ``compute_weight_and_optimizer_memory`` are Megatron-LM's
(``megatron/training``, licence beside them); they call a few helpers of ``megatron.training`` and
a hybrid-pattern counter of later megatron-core releases, which this loader supplies: the tests
check vtrain against the reference itself, not against a re-derivation of it.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).parent
HYBRID_ALLOCATION = "megatron.core.models.hybrid.hybrid_layer_allocation"


def _is_hybrid_model(args: Any) -> bool:  # megatron.training.utils.is_hybrid_model
    return getattr(args, "hybrid_layer_pattern", None) is not None


class _Symbols:  # megatron-core's hybrid layer letters (GDN: a later release's gated delta net)
    MAMBA, GDN, ATTENTION, MLP, MOE = "M", "G", "*", "-", "E"


def _get_hybrid_layer_counts(pattern: str) -> dict[str, int]:
    counts = Counter(pattern)
    return {symbol: counts[symbol] for symbol in (_Symbols.MAMBA, _Symbols.GDN, _Symbols.ATTENTION, _Symbols.MLP,
                                                  _Symbols.MOE)}


def _load(filename: str, names: dict[str, Any]) -> dict[str, Any]:
    source = (HERE / filename).read_text()
    source = source.replace("from .utils import is_hybrid_model, print_rank_0", "")
    namespace = {"__name__": f"megatron_reference.{filename[:-3]}", **names}
    exec(compile(source, str(HERE / filename), "exec"), namespace)  # noqa: S102  (the reference, as published)
    return namespace


def _install_hybrid_allocation() -> None:
    """The module the reference's hybrid branch imports (a later megatron-core's), for 0.16."""
    if HYBRID_ALLOCATION in sys.modules:
        return
    module = types.ModuleType(HYBRID_ALLOCATION)
    module.Symbols = _Symbols
    module.get_hybrid_layer_counts = _get_hybrid_layer_counts
    sys.modules[HYBRID_ALLOCATION] = module


_install_hybrid_allocation()
_FLOPS = _load("num_floating_point_operations.py", {
    "is_hybrid_model": _is_hybrid_model, "is_linear_attention_variant": lambda variant: False,
    "is_gated_delta_net_variant": lambda variant: False})
_MEMORY = _load("theoretical_memory_usage.py", {"is_hybrid_model": _is_hybrid_model, "print_rank_0": print})


def megatron_args(**overrides: Any) -> SimpleNamespace:
    """A Megatron-LM args namespace with the defaults of ``megatron/training/arguments.py`` that the
    reference functions read (after its ``validate_args``: ``kv_channels`` and ``ffn_hidden_size``
    filled in), and ``overrides``."""
    args = SimpleNamespace(
        group_query_attention=False, num_query_groups=None, num_experts=None, moe_layer_freq=1,
        moe_router_topk=2, moe_ffn_hidden_size=None, moe_latent_size=None, moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False, mtp_num_layers=None, swiglu=False, multi_latent_attention=False,
        q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        attention_output_gate=False, experimental_attention_variant=None, linear_attention_freq=None,
        hybrid_layer_pattern=None, mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8,
        mamba_num_heads=None, gdp_num_householder=None, spec=None, linear_key_head_dim=None,
        linear_value_head_dim=None, linear_num_key_heads=None, linear_num_value_heads=None,
        linear_conv_kernel_dim=None, normalization="LayerNorm", add_bias_linear=True,
        untie_embeddings_and_output_weights=False, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1, world_size=1, data_parallel_size=1,
        use_distributed_optimizer=False)
    for name, value in overrides.items():
        setattr(args, name, value)
    if getattr(args, "kv_channels", None) is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if getattr(args, "ffn_hidden_size", None) is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    return args


def num_floating_point_operations(args: SimpleNamespace, batch_size: int) -> float:
    """Megatron-LM's model FLOPs of one global batch of ``batch_size`` sequences."""
    return _FLOPS["num_floating_point_operations"](args, batch_size)


def weight_and_optimizer_bytes(args: SimpleNamespace) -> float:
    """Megatron-LM's ``compute_weight_and_optimizer_memory``: bytes on the most loaded rank."""
    return _MEMORY["compute_weight_and_optimizer_memory"](args)

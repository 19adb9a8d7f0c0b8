"""Which kernels the measured software runs for the ops the tracer records.

The tracer records megatron-core's local layer spec on CPU: unfused attention (``baddbmm``, a
softmax in fp32 between two casts, dropout as ``bernoulli_``/``div_``/``mul``, ``bmm``), torch
LayerNorm (or RMSNorm as a dozen elementwise ops), bias-add and activations as separate ops,
residual dropout-add as five ops, rotary embeddings as a dozen ops per tensor, the vocabulary-
parallel cross-entropy as twenty, and an Adam step of a dozen unfused ops per parameter. A
production stack runs fused kernels instead. A :class:`SoftwareStack` names one such stack; its
mapping rewrites a block's node sequence, replacing each recognised group of consecutive ops by
the kernels that stack launches, with their own FLOPs and bytes (:mod:`vtrain_plugin.cost.lowering.fusion`).
The mapped kernels are then timed like any other op, so the time of a group is the time of its
replacement, not the sum of its traced ops. Groups that match no rule are kept.

- ``local_spec``: the identity (what megatron-core's local spec runs).
- ``megatron_deepspeed_2023``: Megatron-DeepSpeed (2023) in fp16, the software of the vTrain A100
  measurements (:mod:`vtrain_plugin.cost.lowering.megatron_deepspeed`).
- ``megatron_core_te``: Megatron-Core with TransformerEngine (:mod:`vtrain_plugin.cost.lowering.megatron_core_te`),
  in bf16/fp16 or, with ``fp8`` settings, in FP8 (:mod:`vtrain_plugin.cost.lowering.fp8`).
- ``megatron_core_local``: Megatron-Core's local layer spec (``--transformer-impl local``): the
  2023 stack's fused kernels with megatron-core's optimizer, host costs of its own
  (:mod:`vtrain_plugin.cost.lowering.megatron_core_local`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import Node
from vtrain_plugin.core.registry import Registry
from vtrain_plugin.cost.lowering.fp8 import to_fp8
from vtrain_plugin.cost.lowering.megatron_core_local import megatron_core_local
from vtrain_plugin.cost.lowering.megatron_deepspeed import megatron_deepspeed_2023
from vtrain_plugin.cost.lowering.megatron_core_te import group_expert_kernels, megatron_core_te
from vtrain_plugin.cost.lowering.moe_fusion import fuse_permutation, fuse_router
from vtrain_plugin.specs.training import Fp8Settings, SoftwareStack

Mapping = Callable[[Sequence[Node]], tuple[Node, ...]]
_MAPPINGS: Registry[Mapping] = Registry("software stack", plural="stacks")
FP8_STACKS = frozenset({SoftwareStack.MEGATRON_CORE_TE})  # the stacks that run GEMMs in FP8


def register_stack(stack: SoftwareStack) -> Callable[[Mapping], Mapping]:
    return _MAPPINGS.register(stack)


def map_nodes(nodes: Sequence[Node], stack: SoftwareStack | str, fp8: Fp8Settings | None = None, *,
              grouped_experts: bool = False, unfused_attention: bool = False,
              unfused: tuple[str, ...] = (), permute_fusion: bool = False,
              router_fusion: bool = False) -> tuple[Node, ...]:
    """The node sequence of one block as ``stack`` runs it (in FP8 with ``fp8``; with
    ``grouped_experts``, each MoE layer's experts as grouped GEMMs: :func:`group_expert_kernels`;
    with ``permute_fusion`` and ``router_fusion``, its token permutations and routers as TE's fused
    kernels: :func:`fuse_permutation`, :func:`fuse_router`, TE's only: megatron-core refuses them
    without TransformerEngine;
    with ``unfused_attention``, TransformerEngine's unfused attention: the other stacks run
    unfused attention anyway; without the jit fusions ``unfused`` names, ``training.unfused_kernels``:
    ``local_spec`` runs none of them anyway)."""
    for name, on in (("moe_permute_fusion", permute_fusion), ("moe_router_fusion", router_fusion)):
        if on and str(stack) != SoftwareStack.MEGATRON_CORE_TE:
            raise ConfigError(f"model.{name} needs software_stack megatron_core_te (megatron-core refuses the fused "
                              f"MoE kernels without TransformerEngine), got {stack}")
    if (unfused_attention or unfused) and str(stack) == SoftwareStack.MEGATRON_CORE_TE:
        mapped = megatron_core_te(nodes, unfused_attention=unfused_attention, unfused=unfused)
    elif unfused and str(stack) in _UNFUSABLE:
        mapped = _UNFUSABLE[str(stack)](nodes, unfused=unfused)
    else:
        mapped = _MAPPINGS.get(stack)(nodes)
    if fp8 is not None:
        if str(stack) not in FP8_STACKS:
            raise ConfigError(f"training.fp8 {fp8.format.value!r} needs software_stack megatron_core_te (got {stack})")
        mapped = to_fp8(mapped, fp8)
    if permute_fusion:
        mapped = fuse_permutation(mapped)
    if router_fusion:
        mapped = fuse_router(mapped)
    return group_expert_kernels(mapped) if grouped_experts else mapped


# The stacks other than TE whose lowering takes ``unfused`` (local_spec's identity runs none of the fusions).
_UNFUSABLE = {SoftwareStack.MEGATRON_CORE_LOCAL.value: megatron_core_local,
              SoftwareStack.MEGATRON_DEEPSPEED_2023.value: megatron_deepspeed_2023}


@register_stack(SoftwareStack.LOCAL_SPEC)
def _local_spec(nodes: Sequence[Node]) -> tuple[Node, ...]:
    return tuple(nodes)


register_stack(SoftwareStack.MEGATRON_DEEPSPEED_2023)(megatron_deepspeed_2023)
register_stack(SoftwareStack.MEGATRON_CORE_TE)(megatron_core_te)
register_stack(SoftwareStack.MEGATRON_CORE_LOCAL)(megatron_core_local)

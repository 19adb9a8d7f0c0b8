"""Fine-grained activation offloading (``TrainingSpec.activation_offload``): the bytes each layer
sends to host memory, the HBM that frees, and the copy time compute cannot hide.

megatron-core 0.16 (``pipeline_parallel/fine_grained_activation_offload.py``) wraps each named
module in ``off_interface``: every tensor autograd saves inside it (parameters excepted) with at least
``min_offloaded_tensor_size`` elements is copied device-to-host on a side stream when the group
commits after its forward, and host-to-device on another side stream when the layer's backward
starts. The bytes come from the trace (``Block.saved_by_module``) as the stack keeps them
(dropout masks at a byte per element, :mod:`~vtrain_plugin.cost.lowering.dropout_masks`; TransformerEngine's own saves: :func:`~vtrain_plugin.cost.lowering.te_saved.te_saved_by_module`,
the fused attention's :func:`~vtrain_plugin.cost.lowering.megatron_core_te.fused_attention_saved_delta`).
Which traced modules each name covers (the code inside each ``with off_interface(...)``):

- ``attn_norm``: ``input_layernorm``; ``mlp_norm``: ``pre_mlp_layernorm``. Under TransformerEngine
  a norm fused into the next linear is an ``IdentityOp`` and megatron-core offloads nothing for it
  (``TransformerLayer.offload_attn_norm``); the fused attention norm's saves then lie inside
  ``qkv_linear``'s context (``TELayerNormColumnParallelLinear``), the fused MLP norm's in no context;
- ``qkv_linear``: ``get_query_key_value_tensors``: ``linear_qkv`` and the QK norms, or multi-latent
  attention's down and up projections and latent norms;
- ``core_attn``: ``core_attention``; ``attn_proj``: ``linear_proj``;
- ``expert_fc1``: the experts' ``linear_fc1`` (the permuted tokens); ``moe_act``: the experts' own
  activation ops (``bias_act_func``); ``linear_fc2`` runs outside both contexts.

The size floor is applied to a module's bytes as a whole (the trace keeps bytes per module, not per
tensor, taken in the model dtype): a module with fewer bytes than the floor has no tensor at the
floor and offloads nothing; one above it offloads all it keeps. ``fraction`` scales what moves.

Memory: each layer keeps ``saved - offloaded``; after warm-up megatron-core does not offload the
last group of each name (``post_warmup_callback``'s offload margin), so one layer's offloaded bytes
stay on each rank; a group's backward start reloads the next group (``bulk_reload``), so the one
back-propagating and the one ahead of it are back on the GPU, at most one layer's offloaded bytes,
beside that layer's backward (:func:`~vtrain_plugin.cost.memory.backward_rise`).

Time, device-to-host: a group's copy is queued on the offload stream at its commit and nothing in the forward waits for it, so a layer's copies overlap its forward compute and
what exceeds it, ``max(0, offloaded / host_link - compute)``, is exposed (the reload's wait on the
offload event drains the queue). Host-to-device is serial with the backward: the reload of a group
starts only when the backward reaches the start of the group after it in forward order
(``on_group_start_backward``: the reload stream first waits for the compute stream), and the group's
own backward waits for it (``on_group_commit_backward``). Only the backward of what runs outside every
offloaded context between the two groups (e.g. the MoE dispatch between ``mlp_norm`` and
``expert_fc1``) hides a reload (:func:`exposed_reload_ns`); core attention's scores reload in full.
Every rank offloads at once, both ways in the steady state, so a copy runs at the host link's rate
or at the GPU's share of the node's CPU memory bandwidth where lower
(``ClusterSpec.host_copy_gbytes_per_s``: 38.4 GB/s per direction on a DGX H100, below PCIe Gen5's 64).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vtrain_plugin.core.graph import Block, BlockKind
from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta_by_module
from vtrain_plugin.cost.lowering.megatron_core_te import fused_attention_saved_delta, fused_softmax_saved_delta
from vtrain_plugin.cost.lowering.te_saved import te_saved_by_module
from vtrain_plugin.specs.activation_offload import ActivationOffload

_QKV = (".linear_qkv", ".q_layernorm", ".k_layernorm", ".linear_q_proj", ".linear_q_down_proj",
        ".linear_q_up_proj", ".linear_kv_down_proj", ".linear_kv_up_proj", ".kv_layernorm")


def offload_name(module: str, *, te: bool, fused_attention_norm: bool, fused_mlp_norm: bool) -> str | None:
    """The ``--offload-modules`` name whose context saves ``module``'s tensors; None: no context."""
    if ".self_attention." in module + ".":
        tail = module[module.index(".self_attention") + len(".self_attention"):]
        if tail.startswith(".core_attention"):
            return "core_attn"
        if tail.startswith(".linear_proj"):
            return "attn_proj"
        if tail.startswith(_QKV):
            return "qkv_linear"
        return None
    if module.endswith(".input_layernorm"):
        return "qkv_linear" if te and fused_attention_norm else "attn_norm"
    if module.endswith(".pre_mlp_layernorm"):
        return None if te and fused_mlp_norm else "mlp_norm"
    if ".mlp.experts." in module + ".":
        if module.endswith(".linear_fc1"):
            return "expert_fc1"
        if module.endswith(".experts") or module.rpartition(".")[0].endswith(".local_experts"):
            return "moe_act"
    return None


def offloaded_nbytes(block: Block, offload: ActivationOffload | None, *, te: bool, element_nbytes: int,
                     fp8: bool = False, quantised_nbytes: float = 1.0, unfused_attention: bool = False) -> float:
    """Bytes one instance of layer ``block`` offloads per micro-batch (0 for other blocks), as the
    stack keeps them (``te``: megatron_core_te; see the module doc)."""
    return sum(offloaded_by_module(block, offload, te=te, element_nbytes=element_nbytes, fp8=fp8,
                                   quantised_nbytes=quantised_nbytes, unfused_attention=unfused_attention).values())


def offloaded_by_module(block: Block, offload: ActivationOffload | None, *, te: bool, element_nbytes: int,
                        fp8: bool = False, quantised_nbytes: float = 1.0, unfused_attention: bool = False
                        ) -> dict[str, float]:
    """Bytes one instance of layer ``block`` offloads per micro-batch, by the traced module whose saves
    they are (an attention's internals as its ``core_attention``); empty for other blocks."""
    if offload is None or block.kind is not BlockKind.LAYER:
        return {}
    modules = [m for m, _ in block.saved_by_module]
    fused_attention_norm = any(m.endswith(".self_attention.linear_qkv") for m in modules)
    fused_mlp_norm = any(m.endswith(".mlp.linear_fc1") for m in modules)
    kept = kept_by_module(block, te=te, fp8=fp8, quantised_nbytes=quantised_nbytes,
                          unfused_attention=unfused_attention)
    out: dict[str, float] = {}
    for module, nbytes in kept.items():
        name = offload_name(module, te=te, fused_attention_norm=fused_attention_norm, fused_mlp_norm=fused_mlp_norm)
        if name in offload.modules and nbytes >= offload.min_tensor_elements * element_nbytes:
            out[module] = nbytes * offload.fraction
    return out


def kept_by_module(block: Block, *, te: bool, fp8: bool = False, quantised_nbytes: float = 1.0,
                   unfused_attention: bool = False) -> dict[str, int]:
    """Bytes one instance of ``block`` keeps for backward per micro-batch, by module, as the stack
    keeps them (``te``: megatron_core_te; the core attention's internals as one module): the trace's
    saves with the dropout masks at a byte per element, TransformerEngine's own saves and its
    attention's (fused, or the fused softmax's with ``unfused_attention``)."""
    kept: dict[str, int] = {}
    masks = dropout_mask_delta_by_module(block)
    for module, nbytes in block.saved_by_module:
        head, core, _ = module.partition(".core_attention.")
        key = head + ".core_attention" if core else module
        kept[key] = kept.get(key, 0) + nbytes + masks.pop(module, 0)
    if te:
        for module, delta in te_saved_by_module(block, fp8=fp8, quantised_nbytes=quantised_nbytes).items():
            kept[module] = kept.get(module, 0) + delta
        core = next((m for m in kept if m.endswith(".self_attention.core_attention")), None)
        if core is not None:
            delta = (fused_softmax_saved_delta if unfused_attention else fused_attention_saved_delta)(block.nodes)
            kept[core] = kept[core] + delta
    return kept


def offload_groups(forward_modules: Sequence[str], offloaded: Mapping[str, float]) -> list[tuple[float, list[str]]]:
    """The layer's offload groups in forward order: each group's bytes and the modules that run after
    it, outside every offloaded module, until the next group (the last group's run wraps round to the
    layer's start: the next layer instance's). ``forward_modules``: the layer's modules in the order
    its forward calls them; ``offloaded``: :func:`offloaded_by_module`'s bytes (a saving module that
    is no module of the forward, such as a core attention's internals, counts as its first
    submodule)."""
    def owner(module: str) -> str | None:
        return max((m for m in offloaded if module == m or module.startswith(m + ".")), key=len, default=None)

    groups: list[tuple[float, list[str]]] = []
    leading: list[str] = []
    seen: set[str] = set()
    for module in forward_modules:
        key = owner(module)
        if key is None:
            (groups[-1][1] if groups else leading).append(module)
        elif key not in seen:
            seen.add(key)
            groups.append((offloaded[key], []))
    if groups:
        groups[-1][1].extend(leading)
    return groups


def exposed_reload_ns(groups: Sequence[tuple[float, Sequence[str]]], backward_ns_by_module: Mapping[str, float],
                      host_link_gbytes_per_s: float) -> float:
    """Host-to-device time of one layer instance's reloads that its backward waits for: each group's
    copy beyond the backward of the modules between it and the next group (:func:`offload_groups`)."""
    return sum(exposed_copy_ns(nbytes, sum(backward_ns_by_module.get(m, 0.0) for m in hiding), host_link_gbytes_per_s)
               for nbytes, hiding in groups)


def exposed_copy_ns(nbytes: float, compute_ns: float, host_link_gbytes_per_s: float) -> float:
    """Copy time of ``nbytes`` over the host link beyond the ``compute_ns`` it runs beside."""
    return max(0.0, nbytes / host_link_gbytes_per_s - compute_ns)  # GB/s = bytes/ns

"""Megatron-Core's MoE layer on the fake process group, traced under a routing assumption.

The layer is megatron-core's own ``MoELayer``: its ``TopKRouter`` (gating GEMM, top-k, softmax,
load-balancing loss), its token dispatcher (permutation, the all-to-all or all-gather of tokens over
the expert groups, the sort by local expert, the combine) and ``SequentialMLP`` experts (one
megatron ``MLP`` per local expert: the experts that run without TransformerEngine or the
``grouped_gemm`` package). Every op and collective of it is traced as it runs.

Fake tensors cannot give one thing: how many tokens the router sends to each expert. Megatron
copies these counts to the host (numpy arrays) to size the all-to-all and split the tokens among
the local experts; the dispatchers below take them from the routing assumption of
:mod:`megatron_adapters.moe_routing` instead, and the one op whose output size depends on them,
the dropless permutation's ``masked_select``, runs as the ``nonzero`` + gather it is on the GPU with
its count known (:func:`_masked_select`). Nothing is synthesized: the all-to-all and the expert
GEMMs are megatron's, with the shapes the assumption gives.

The flex dispatcher is megatron-core's ``MoEFlexTokenDispatcher`` with one stand-in: its fused
DeepEP / HybridEP kernels need CUDA, so :class:`AssumedFlexManager` runs what megatron's DeepEP
manager runs around them (the top-k of the routing map, the conversion of the received indices to
a per-expert map, megatron's permutation) and, for each fused dispatch or combine, one all-to-all
over expert TP x EP of the bytes DeepEP moves: a rank's tokens, each once per destination rank
(:meth:`megatron_adapters.flex_routing.FlexDispatch.ranks_hit`), priced as DeepEP's
kernels by :func:`vtrain_plugin.cost.comm.moe_dispatch.flex_time_ns`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe import token_dispatcher as dispatchers
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from megatron_adapters.flex_routing import FlexDispatch
from megatron_adapters.moe_routing import DispatchCounts, expert_token_counts
from vtrain_plugin.core.errors import ConfigError, TraceError
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, TokenDispatcher

# The names TopKRouter logs its auxiliary losses under (aux_loss, seq_aux_loss, global_aux_loss).
LOAD_BALANCING_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
# Megatron-LM's Mixtral / DeepSeek recipes: auxiliary load-balancing loss with coefficient 1e-2.
LOAD_BALANCING = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
# Sinkhorn routing: megatron-core's router asserts that no auxiliary loss comes with it.
SINKHORN = dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)


def moe_config_fields(model: ModelSpec, plan: ParallelPlan) -> dict:
    """The TransformerConfig fields of ``model``'s MoE layers under ``plan`` (none for a dense model):
    unfused permutation and router (their fused kernels are a lowering:
    :mod:`vtrain_plugin.cost.lowering.moe_fusion`), local experts; softmax before the top-k when the model asks or k is 1
    (megatron-core requires it: a softmax over one expert has no gradient); the model's MoE features
    as megatron-core names them (:func:`moe_feature_fields`); the router's load balancing
    (:func:`load_balancing_fields`), sinkhorn's iterations by the stand-in
    :func:`megatron_adapters.stand_ins.sinkhorn`."""
    if not model.is_moe:
        return {}
    # megatron-core cannot build the flex dispatcher without DeepEP: the layer is built with the
    # all-to-all one, which prepare_moe_layers replaces by the flex stand-in.
    built = "alltoall" if plan.moe_token_dispatcher is TokenDispatcher.FLEX else plan.moe_token_dispatcher.value
    return dict(num_moe_experts=model.num_experts, moe_router_topk=model.router_topk,
                moe_ffn_hidden_size=model.expert_ffn_size, expert_model_parallel_size=plan.expert_parallel,
                expert_tensor_parallel_size=plan.expert_tp, moe_token_dispatcher_type=built,
                moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                moe_router_pre_softmax=model.moe_router_pre_softmax or model.router_topk == 1,
                **load_balancing_fields(model), **moe_feature_fields(model, plan))


def load_balancing_fields(model: ModelSpec) -> dict:
    """The router's load balancing as TransformerConfig fields: sinkhorn without a loss, or the
    model's auxiliary loss (per micro-batch, per sequence or over the global batch) with the
    coefficient of Megatron-LM's recipes."""
    kind = model.moe_router_load_balancing_type.value
    return SINKHORN if kind == "sinkhorn" else dict(LOAD_BALANCING, moe_router_load_balancing_type=kind)


def moe_feature_fields(model: ModelSpec, plan: ParallelPlan) -> dict:
    """The MoE features ``model`` sets away from megatron-core's defaults, as TransformerConfig fields:
    shared experts, the router's score function and dtype, group-limited top-k, expert bias and top-k scaling,
    the capacity factor, padding and drop policy. Two are costed rather than traced, and reach
    megatron-core off: grouped-GEMM experts (the SequentialMLP traced here is lowered to one grouped
    kernel per linear, :func:`vtrain_plugin.cost.lowering.megatron_core_te.group_expert_kernels`)
    and the shared expert's overlap with the all-to-all (megatron-core runs it on a second CUDA
    stream; :mod:`vtrain_plugin.cost.comm.overlap` pairs the two)."""
    if model.moe_shared_expert_overlap and plan.moe_token_dispatcher.value != "alltoall":
        raise ConfigError(f"model.moe_shared_expert_overlap needs parallel.moe_token_dispatcher alltoall "
                          f"(megatron-core's rule), got {plan.moe_token_dispatcher.value}")
    fields: dict = {}
    if model.moe_shared_expert_intermediate_size is not None:
        fields["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    if model.moe_router_score_function.value != "softmax":
        fields["moe_router_score_function"] = model.moe_router_score_function.value
    if model.moe_router_num_groups is not None:
        fields.update(moe_router_num_groups=model.moe_router_num_groups,
                      moe_router_group_topk=model.moe_router_group_topk)
    if model.moe_router_enable_expert_bias:
        fields["moe_router_enable_expert_bias"] = True
    if model.moe_router_dtype is not None:
        fields["moe_router_dtype"] = model.moe_router_dtype.value
    if model.moe_router_topk_scaling_factor is not None:
        fields["moe_router_topk_scaling_factor"] = model.moe_router_topk_scaling_factor
    if model.moe_expert_capacity_factor is not None:
        fields.update(moe_expert_capacity_factor=model.moe_expert_capacity_factor,
                      moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
                      moe_token_drop_policy=model.moe_token_drop_policy.value)
    return fields


def moe_layer_spec(model: ModelSpec):
    """The MLP spec of a MoE layer: megatron's local MoE spec (SequentialMLP experts)."""
    return get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=model.num_experts,
                                           moe_grouped_gemm=False)


def prepare_moe_layers(module: torch.nn.Module, skew: float, flex: FlexDispatch | None = None) -> None:
    """Make the MoE layers under ``module`` traceable as a steady-state step (build it under the
    fake mode that runs the step).

    Each layer gets a token dispatcher of the same kind and process groups that takes its token
    counts from the routing assumption with skew ``skew`` (with ``flex``, the flex dispatcher over
    the same groups, :class:`AssumedFlexDispatcher`). Megatron's per-layer log of the
    load-balancing losses (a global of moe_utils) is allocated here: its training loop allocates it at
    the first step and only zeroes it later, and a log left by an earlier trace holds tensors of
    another fake mode.
    """
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    if layers:
        config = layers[0].config  # sized as the router sizes it: the MTP layers' MoE layers log there too
        for name in LOAD_BALANCING_LOSSES:
            tracker[name] = {"values": torch.zeros(config.num_layers + (config.mtp_num_layers or 0))}
    for layer in layers:
        if not isinstance(layer, MoELayer):
            continue
        built = layer.token_dispatcher
        kind = {dispatchers.MoEAlltoAllTokenDispatcher: AssumedAlltoAllDispatcher,
                dispatchers.MoEAllGatherTokenDispatcher: AssumedAllGatherDispatcher}[type(built)]
        groups = ProcessGroupCollection(ep=built.ep_group, expt_tp=built.tp_group, tp_ep=built.tp_ep_group)
        if flex is not None:
            layer.token_dispatcher = AssumedFlexDispatcher(layer.num_local_experts, layer.local_expert_indices,
                                                           config=layer.config, pg_collection=groups,
                                                           routing_skew=skew, flex=flex)
            continue
        layer.token_dispatcher = kind(layer.num_local_experts, layer.local_expert_indices, config=layer.config,
                                      pg_collection=groups, routing_skew=skew)


class AssumedAlltoAllDispatcher(dispatchers.MoEAlltoAllTokenDispatcher):
    """The all-to-all dispatcher, its host-side counts from the routing assumption."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, routing_skew: float):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.routing_skew = routing_skew
        # Index tables megatron builds with torch.arange on the host: fake here, so built again as
        # the host arrays they are.
        idx = np.arange(self.num_experts * self.tp_size)
        self.sort_input_by_local_experts = idx.reshape(-1, self.num_local_experts).T.ravel()
        self.restore_output_by_local_experts = idx.reshape(self.num_local_experts, -1).T.ravel()

    def preprocess(self, routing_map: torch.Tensor):
        """Megatron's preprocessing (its per-expert count and the all-gather of the counts are
        traced), then the counts the assumption gives, on the host as megatron holds them."""
        device_tokens = super().preprocess(routing_map)
        # The device-side counts megatron copies to the host at its D2H point, before the
        # assumption's host values replace them (see _maybe_dtoh_and_synchronize).
        self.device_counts = [t for t in (device_tokens, self.input_splits, self.output_splits, self.output_splits_tp,
                                          self.num_out_tokens,
                                          self.num_global_tokens_per_local_expert if self.num_local_experts > 1
                                          else None) if torch.is_tensor(t)]
        counts = DispatchCounts(per_expert=_routed_counts(routing_map.size(0), self.config, self.routing_skew),
                                ep=self.ep_size, etp=self.tp_size)
        if self.drop_and_pad:  # megatron sized the even all-to-all from the capacity itself
            return counts.tokens_per_local_expert
        if self.config.moe_expert_capacity_factor is not None:  # dropped pairs leave the permutation
            self.num_out_tokens = int(sum(counts.per_expert))
        if self.ep_size > 1 or self.tp_size > 1:
            self.input_splits = counts.input_splits
            self.output_splits = counts.output_splits
            self.output_splits_tp = counts.output_splits_tp
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = counts.global_tokens_per_local_expert
        return counts.tokens_per_local_expert

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        with _known_count_permute():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        """The counts are on the host already; at megatron's D2H point its copies of the device-side
        counts (``maybe_move_tensor_to_cpu``, one ``.to("cpu", non_blocking=True)`` each) are traced
        as the copies they are. The wait that follows is placed by the costing
        (:mod:`vtrain_plugin.cost.host_syncs`)."""
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for counts in getattr(self, "device_counts", ()):
                host_copy(counts)
            self.device_counts = []
        return tokens_per_expert


class AssumedAllGatherDispatcher(dispatchers.MoEAllGatherTokenDispatcher):
    """The all-gather dispatcher, its local token counts from the routing assumption."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, routing_skew: float):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.routing_skew = routing_skew

    def dispatch_postprocess(self, hidden_states, probs):
        """megatron-core 0.16's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` with the local
        counts from the assumption and its ``masked_select`` as :func:`_masked_select`."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        self.local_probs = probs[:, first:last].contiguous()
        host_copy(self.local_map.sum(dim=0))  # megatron counts the local pairs on the device, then copies them
        local_tokens = hidden_states.size(0) // (self.tp_size * self.ep_size)
        per_expert = _routed_counts(local_tokens, self.config, self.routing_skew)
        tokens_per_expert = DispatchCounts(per_expert=per_expert, ep=self.ep_size,
                                           etp=self.tp_size).tokens_per_local_expert
        permuted, _, self.reversed_local_input_permutation_mapping = _permute(
            hidden_states, self.local_map, num_out_tokens=int(tokens_per_expert.sum()))
        self.local_probs = _masked_select(self.local_probs.T.contiguous(), self.local_map.T.contiguous(),
                                          int(tokens_per_expert.sum()))
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs


class AssumedFlexDispatcher(dispatchers.MoEFlexTokenDispatcher):
    """megatron-core's flex dispatcher with :class:`AssumedFlexManager` for its DeepEP manager."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, routing_skew: float,
                 flex: FlexDispatch):
        dispatchers.MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self._comm_manager = AssumedFlexManager(self, routing_skew, flex)


class AssumedFlexManager(dispatchers._DeepepManager):
    """megatron-core 0.16's ``_DeepepManager`` with its fused kernels as one all-to-all each (see
    the module doc) and the received token counts from the routing assumption."""

    def __init__(self, dispatcher: AssumedFlexDispatcher, routing_skew: float, flex: FlexDispatch):
        self.group = dispatcher.tp_ep_group
        self.num_local_experts = dispatcher.num_local_experts
        self.config = dispatcher.config
        self.router_topk = dispatcher.tp_size * self.config.moe_router_topk
        self.num_experts = dispatcher.tp_size * self.config.num_moe_experts
        self.router_dtype = self.config.moe_router_dtype
        self.capacity_factor = self.config.moe_expert_capacity_factor
        self.permute_fusion = False
        self.token_indices = self.token_probs = self.handle = None
        self.ep_size, self.etp_size = dispatcher.ep_size, dispatcher.tp_size
        self.routing_skew = routing_skew
        self.ranks_hit = flex.ranks_hit()

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's fused dispatch: the tokens each destination rank receives (once per rank), their
        top-k indices and probabilities (fp32, as DeepEP takes them), the counts per local expert."""
        self.num_tokens = hidden_states.size(0)
        received = max(1, round(self.num_tokens * self.ranks_hit))
        self.received = received
        per_expert = _routed_counts(self.num_tokens, self.config, self.routing_skew)
        self.tokens_per_expert = DispatchCounts(per_expert=per_expert, ep=self.ep_size,
                                                etp=self.etp_size).tokens_per_local_expert
        self.dispatched_indices = self.token_indices.new_empty(received, self.router_topk)
        self.dispatched_probs = _CarriedAlong.apply(self.token_probs.float(), received)
        return _FlexAllToAll.apply(hidden_states, received, received, self.group)

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's fused combine: the experts' outputs back to their tokens' ranks, summed there."""
        return _FlexAllToAll.apply(hidden_states, self.received, self.num_tokens, self.group)

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        """megatron's conversion of the received top-k indices to a per-local-expert map (its
        unfused variant selects with data-dependent masks; here one scatter of the same size), then
        its permutation by local expert with the count the assumption gives."""
        routing_map = torch.zeros(self.received, self.num_local_experts, dtype=torch.bool,
                                  device=hidden_states.device)
        routing_map = routing_map.scatter(1, self.dispatched_indices.clamp(0, self.num_local_experts - 1), True)
        probs = torch.zeros(self.received, self.num_local_experts, dtype=torch.float32, device=hidden_states.device)
        probs = probs.scatter(1, self.dispatched_indices.clamp(0, self.num_local_experts - 1), self.dispatched_probs)
        self.dispatched_routing_map = routing_map
        self.hidden_shape_before_permute = hidden_states.shape
        hidden_states, permuted_probs, self.reversed_mapping_for_combine = _permute(
            hidden_states, routing_map, probs=probs, num_out_tokens=int(self.tokens_per_expert.sum()))
        return hidden_states, permuted_probs

    def get_number_of_tokens_per_expert(self):
        return self.tokens_per_expert


class _FlexAllToAll(torch.autograd.Function):
    """One fused DeepEP kernel as the all-to-all of its volume: ``wire_rows`` rows of the hidden size
    over ``group`` (the tokens received, once per destination rank), ``out_rows`` rows out; its
    backward is the kernel of the other direction (dispatch's is a combine and vice versa)."""

    @staticmethod
    def forward(ctx, tokens, wire_rows, out_rows, group):
        ctx.wire_rows, ctx.in_rows, ctx.group = wire_rows, tokens.size(0), group
        return _exchange(tokens, wire_rows, out_rows, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.wire_rows, ctx.in_rows, ctx.group), None, None, None


class _CarriedAlong(torch.autograd.Function):
    """What DeepEP's dispatch sends in the same kernel as the tokens (their top-k probabilities, a
    few bytes per token): ``rows`` rows out, its gradient back in the combine; no op of its own."""

    @staticmethod
    def forward(ctx, values, rows):
        ctx.shape = values.shape
        return values.new_empty(rows, values.size(-1))

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(ctx.shape), None


def _exchange(tokens: torch.Tensor, wire_rows: int, out_rows: int, group) -> torch.Tensor:
    hidden = tokens.size(-1)
    send = tokens if tokens.size(0) == wire_rows else tokens.new_empty(wire_rows, hidden)
    received = tokens.new_empty(wire_rows, hidden)
    size = group.size()
    splits = [wire_rows // size + (1 if i < wire_rows % size else 0) for i in range(size)]
    torch.distributed.all_to_all_single(received, send, splits, splits, group=group)
    return received if out_rows == wire_rows else tokens.new_empty(out_rows, hidden)


def host_copy(counts: torch.Tensor) -> torch.Tensor:
    """Megatron's copy of a device tensor of token counts to the host (``.cpu()``, ``.to("cpu")``):
    one copy of its bytes. The tracing tensors are host tensors already, where ``.to("cpu")`` would
    be no op at all, so the copy is made explicit."""
    return torch.ops.aten._to_copy.default(counts)


def _routed_counts(tokens: int, config, skew: float) -> tuple[int, ...]:
    """The routing assumption's pairs per expert from one rank of ``tokens`` tokens, under the
    config's capacity factor and padding."""
    return expert_token_counts(tokens, config.moe_router_topk, config.num_moe_experts, skew,
                               capacity_factor=config.moe_expert_capacity_factor,
                               pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity))


def _masked_select(values: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """``values.masked_select(mask)`` when ``count`` elements are selected: on the GPU a nonzero
    over the mask and a gather, which is what runs here, with the output size known."""
    selected = torch.nonzero_static(mask.reshape(-1), size=count).squeeze(1)
    return values.reshape(-1).index_select(0, selected)


def _permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
    """megatron-core 0.16's unfused dropless ``permute`` (moe_utils) with ``num_out_tokens`` pairs
    selected by :func:`_masked_select`; the drop-and-pad variant is megatron's own (its shapes are
    static: every expert takes its capacity). The fused variant is never traced: ``moe_permute_fusion``
    reaches megatron-core off and is costed as TE's kernels (:mod:`vtrain_plugin.cost.lowering.moe_fusion`);
    reaching it here means megatron-core called the permutation in a way this adapter does not know."""
    if drop_and_pad and not fused and num_out_tokens is not None:
        return _MEGATRON_PERMUTE(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=False,
                                 drop_and_pad=True)
    if fused or drop_and_pad or num_out_tokens is None:
        raise TraceError(f"megatron-core asked for a MoE permutation vtrain does not trace (fused={fused}, "
                         f"drop_and_pad={drop_and_pad}, num_out_tokens={num_out_tokens}); vtrain traces "
                         f"the unfused dropless one")
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = _masked_select(token_indices, routing_map, int(num_out_tokens))
    permuted_probs = None if probs is None else _masked_select(probs.T.contiguous(), routing_map,
                                                               int(num_out_tokens))
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


_MEGATRON_PERMUTE = dispatchers.permute


@contextlib.contextmanager
def _known_count_permute() -> Iterator[None]:
    """Megatron's dispatcher calls ``permute`` by its module-level name; for the block, that name
    is :func:`_permute`."""
    original = dispatchers.permute
    dispatchers.permute = _permute
    try:
        yield
    finally:
        dispatchers.permute = original

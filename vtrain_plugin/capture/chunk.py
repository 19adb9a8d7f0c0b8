"""One traced chunk role and the shape key it is cached under, in process and on disk.

A chunk's trace depends on the model's dimensions, on the plan's tensor parallelism, sequence
parallelism, micro-batch size, recompute mode and context parallelism (the chunk runs on one CP
rank's tokens; how CP ranks exchange keys and values is derived when costing), and, for MoE layers,
its expert parallelism, expert tensor parallelism and token dispatcher; on the chunk's role (whether
it holds the embedding, the head) and on the number of layers built; not on data parallelism, the
number of pipeline stages beyond whether there are several, nor the model's layer count (the folded
layer stands for all of them). :func:`shape_key` names exactly these inputs, so plans that share a key
share the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from vtrain_plugin.capture.node_table import SharedNodes, pack_blocks, unpack_blocks
from vtrain_plugin.core.graph import Block
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

# The fields of plan_shape_key, then of shape_key after the model's dimensions.
PLAN_SHAPE_FIELDS = ("tensor_parallel", "sequence_parallel", "micro_batch_size", "recompute", "pipelined",
                     "context_parallel", "expert_parallel", "expert_tensor_parallel", "moe_token_dispatcher")
SHAPE_FIELDS = ("model", *PLAN_SHAPE_FIELDS, "pre_process", "post_process", "traced_layers")


@dataclass(frozen=True, slots=True)
class ChunkTrace:
    """What one traced chunk role yields; independent of PP, DP and the chunk's layer count."""

    blocks: tuple[Block, ...]  # layers not yet folded
    params_by_block: dict[str, tuple[int, ...]]  # each parameter's elements per block name (per layer)
    # of those, the parameters reduced over expert DP (experts split by expert parallelism), apart
    expert_params_by_block: dict[str, tuple[int, ...]]
    word_embedding_params: int  # of the (possibly shared) word embedding / output weight here
    activation_shape: tuple[int, ...]
    activation_dtype: str
    held_nbytes: int = 0  # StageGraph.held_nbytes and backward_peak_nbytes, as the recorder measured them
    backward_peak_nbytes: int = 0
    held_outside_attention_nbytes: int = 0  # and their StageGraph.*_outside_attention_nbytes
    backward_peak_outside_attention_nbytes: int = 0
    gpu_softmax_backward_peak_nbytes: int = 0  # and StageGraph.gpu_softmax_backward_peak_nbytes
    # Folded blocks per chunk layer count, filled by the tracer: every stage of this role (in every
    # plan that shares the trace) gets the same blocks, folded once. Not part of the stored form.
    # (keyed by the layer count; by the layer kinds, True for MoE, of a chunk that mixes MoE and dense
    # layers; by (layer count, NoPE?, windowed or NoPE layers) for alternating windows or NoPE layers; or
    # by a hybrid stage's pattern).
    folded: dict[int | tuple[bool, ...] | tuple[int, bool, int] | str, tuple[Block, ...]] = field(
        default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": [b.to_dict() for b in self.blocks], **self._fields()}

    def to_tables(self) -> dict[str, Any]:
        """:meth:`to_dict` with the blocks packed as tables (:func:`~vtrain_plugin.capture.node_table.pack_blocks`):
        the trace cache's form, read back by :meth:`from_tables`."""
        return {"blocks": pack_blocks(self.blocks), **self._fields()}

    def _fields(self) -> dict[str, Any]:
        return {"params_by_block": {k: list(n) for k, n in self.params_by_block.items()},
                "expert_params_by_block": {k: list(n) for k, n in self.expert_params_by_block.items()},
                "word_embedding_params": self.word_embedding_params,
                "activation_shape": list(self.activation_shape), "activation_dtype": self.activation_dtype,
                "held_nbytes": self.held_nbytes, "backward_peak_nbytes": self.backward_peak_nbytes,
                "held_outside_attention_nbytes": self.held_outside_attention_nbytes,
                "backward_peak_outside_attention_nbytes": self.backward_peak_outside_attention_nbytes,
                "gpu_softmax_backward_peak_nbytes": self.gpu_softmax_backward_peak_nbytes}

    @classmethod
    def from_tables(cls, d: dict[str, Any], shared: SharedNodes | None = None) -> ChunkTrace:
        """:meth:`to_tables`'s form read back; equal nodes taken from ``shared`` when given (:func:`unpack_blocks`)."""
        return cls._of(d, unpack_blocks(d["blocks"], shared))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkTrace:
        return cls._of(d, tuple(Block.from_dict(b) for b in d["blocks"]))

    @classmethod
    def _of(cls, d: dict[str, Any], blocks: tuple[Block, ...]) -> ChunkTrace:
        return cls(blocks=blocks,
                   params_by_block={str(k): tuple(int(x) for x in n) for k, n in d["params_by_block"].items()},
                   expert_params_by_block={str(k): tuple(int(x) for x in n)
                                           for k, n in d["expert_params_by_block"].items()},
                   word_embedding_params=int(d["word_embedding_params"]),
                   activation_shape=tuple(int(n) for n in d["activation_shape"]),
                   activation_dtype=str(d["activation_dtype"]), held_nbytes=int(d["held_nbytes"]),
                   backward_peak_nbytes=int(d["backward_peak_nbytes"]),
                   held_outside_attention_nbytes=int(d["held_outside_attention_nbytes"]),
                   backward_peak_outside_attention_nbytes=int(d["backward_peak_outside_attention_nbytes"]),
                   gpu_softmax_backward_peak_nbytes=int(d["gpu_softmax_backward_peak_nbytes"]))


def plan_shape_key(plan: ParallelPlan) -> tuple:
    """What of a plan its chunk traces depend on (:data:`PLAN_SHAPE_FIELDS`): plans with different
    keys share no chunk trace (the plan search groups plans by it, so that each shape is traced in
    one process)."""
    return (plan.tensor_parallel, plan.sequence_parallel, plan.micro_batch_size, _recompute_key(plan),
            plan.pipeline_parallel > 1, plan.context_parallel, plan.expert_parallel, plan.expert_tp,
            plan.moe_token_dispatcher.value)


def _recompute_key(plan: ParallelPlan) -> str:
    """The recompute mode, with the selectively recomputed modules where they are not the default
    (so a plan without them keeps its key and its cached traces)."""
    if plan.recompute_modules is None:
        return plan.recompute.value
    return f"{plan.recompute.value}:{'+'.join(plan.recompute_modules)}"


def shape_key(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int | tuple[bool, ...]) -> tuple:
    """The key of one chunk role's trace (:data:`SHAPE_FIELDS`); hashable and cheap, as the tracer
    looks it up once per stage of every plan."""
    return (model_dims(model), *plan_shape_key(plan), pre, post, built)


def named_shape_key(key: tuple) -> dict[str, Any]:
    """:func:`shape_key`'s tuple as a JSON mapping, field by field: the on-disk cache's key."""
    named = dict(zip(SHAPE_FIELDS, key, strict=True))
    named["model"] = dict(named["model"])
    return named


# Fields that do not change a chunk's trace: TransformerEngine applies a zero-centered gamma inside
# its norm kernels, and the local spec's norms traced here take none; a per-layer pattern of MoE and
# dense layers enters as the kinds of the chunk's layers, not as the model's pattern.
MODEL_FIELDS_NOT_TRACED = ("num_layers", "name", "layernorm_zero_centered_gamma", "moe_layer_freq")
# The ModelSpec fields every shape key names. A field added to ModelSpec since is named only when
# set away from its default, so a model without the feature keeps its key (and its cached traces).
KEYED_MODEL_FIELDS = frozenset({
    "family", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "ffn_hidden_size",
    "num_query_groups", "tied_embeddings", "dtype", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_routing_skew", "moe_shared_expert_intermediate_size"})


# ModelSpec fields that change how a trace is costed, not the trace: grouped-GEMM experts are a
# lowering of the traced SequentialMLP, TE's fused permutation and router kernels lowerings of the
# traced unfused ops (vtrain_plugin.cost.lowering.moe_fusion), the shared expert's overlap a
# pairing of kernels and collectives (vtrain_plugin.cost.prepare reads them from the graph's model).
COSTED_MODEL_FIELDS = frozenset({"moe_grouped_gemm", "moe_shared_expert_overlap", "moe_permute_fusion",
                                 "moe_router_fusion"})


@lru_cache(maxsize=256)
def model_dims(model: ModelSpec) -> tuple:
    """Every field of ``model`` a chunk's trace depends on (all but :data:`MODEL_FIELDS_NOT_TRACED` and
    :data:`COSTED_MODEL_FIELDS`); a field outside :data:`KEYED_MODEL_FIELDS` at its default (the
    family's layer, no MoE feature) is left out, so a model without the feature keeps its key."""
    defaults = ModelSpec(num_layers=1, hidden_size=1, num_attention_heads=1, seq_length=1).to_dict()
    dims = {k: v for k, v in model.to_dict().items()
            if k not in (*MODEL_FIELDS_NOT_TRACED, *COSTED_MODEL_FIELDS)
            and (k in KEYED_MODEL_FIELDS or v != defaults[k])}
    return tuple(sorted(dims.items()))

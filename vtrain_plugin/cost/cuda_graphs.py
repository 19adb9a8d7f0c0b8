"""CUDA graphs: the host cost of the captured kernels and the memory of the graphs' static buffers.

A captured region (each transformer layer, or the parts ``training.cuda_graph_scope`` names, or
with ``full_iteration`` every forward and backward) is replayed by one ``cudaGraphLaunch``: its
kernels, collectives and module calls cost the host nothing, the launch costs one kernel launch
(``host_overhead_ns``) before the region's first kernel. Device times are unchanged. The scopes are
megatron-core 0.16's (``CudaGraphScope``, ``TransformerLayer._get_submodules_under_cudagraphs``):
``mlp`` captures the MLP of dense layers only and ``moe`` the whole MoE block of MoE layers;
``moe_router`` the pre-MLP norm, the router and the shared experts (unless they overlap the
dispatch); ``moe_preprocess`` with it the dispatcher's preprocessing, the MoE block's own ops
before its first token all-to-all (after its last one in the backward) but for the copies of the
token counts to the host, which megatron then makes outside the graph before the all-to-all. The
rest of a MoE layer (dispatch, experts, combine) runs eagerly and costs the host as without graphs.
A multi-token-prediction layer's transformer layer is captured like a decoder layer (megatron-core's
graph helpers take it with them), though it is traced in the head.

Memory (megatron-core 0.16 ``transformer/cuda_graphs.py``, ``_CudaGraphRunner``): a captured layer
holds static buffers in the graphs' pool beside what training keeps anyway: its input, cloned
(``create_fwd_graph(clone_inputs=True)``), the gradient of its output (``static_grad_outputs``) and
its weight gradients (``static_grad_inputs``, the wgrads cloned out after each replay), in the
model dtype. The pool is shared by the graphs of every micro-batch (one mempool, replayed in
capture order), so these are counted once per captured layer; they join the allowance. What a
captured region saves for backward lives in that pool too: a replay allocates nothing, so
``max allocated`` sees those saves only while the graphs are captured. TransformerEngine's graphs
(``TECudaGraphHelper``, ``make_graphed_callables`` with the schedule's ``_order``) are captured after
``--cuda-graph-warmup-steps`` eager iterations; with none, no step ever holds the captured saves
eagerly, and the peak is the larger of the capture (the captured saves in the schedule's order, with
the captured attention's backward) and the replayed steps (the rest, with the step's transient):
:func:`captured_apart`, :func:`captured_saved_nbytes`. Why this
module: graphs change the host side of the host/device pipeline, which is what makes small models slow.
"""

from __future__ import annotations

import re

import numpy as np

from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, Phase
from vtrain_plugin.cost.activation_offload import kept_by_module
from vtrain_plugin.core.units import GIB
from vtrain_plugin.specs.training import CudaGraphImpl, TrainingSpec

# Module path parts each scope captures (megatron-core's TransformerLayer: the attention part runs
# the input norm, the MLP part the pre-MLP norm; a Mamba layer's mixer and its norm). "mlp" applies to
# dense layers, "moe", "moe_router" and "moe_preprocess" to MoE layers (see the module doc).
_SCOPE_MODULES = {
    "attn": (".self_attention", ".input_layernorm"),
    "mlp": (".mlp", ".pre_mlp_layernorm"),
    "moe": (".mlp", ".pre_mlp_layernorm"),
    "moe_router": (".pre_mlp_layernorm", ".mlp.router", ".mlp.shared_experts"),
    "moe_preprocess": (".pre_mlp_layernorm", ".mlp.router", ".mlp.shared_experts"),
    "mamba": (".mixer", ".norm"),
}
_MTP_LAYER = re.compile(r"(^|\.)mtp\.layers\.\d+\.transformer_layer(\.|$)")
_DENSE_ONLY = frozenset({"mlp"})
_MOE_ONLY = frozenset({"moe", "moe_router", "moe_preprocess"})
_ROUTER = ".mlp.router"
_SHARED_EXPERTS = ".mlp.shared_experts"


def graphed(training: TrainingSpec) -> bool:
    return training.cuda_graph_impl is not CudaGraphImpl.NONE


def _captures(module: str, in_layer: bool, scopes: tuple[str, ...], moe_layer: bool = False,
              shared_expert_overlap: bool = False) -> bool:
    if "full_iteration" in scopes:
        return True
    if not scopes:
        return in_layer
    path = module + "."
    if shared_expert_overlap and _SHARED_EXPERTS + "." in path and not (moe_layer and "moe" in scopes):
        return False  # overlapped with the dispatch, outside the router's graph
    return in_layer and any(part + "." in path for scope in scopes
                            if not (moe_layer and scope in _DENSE_ONLY or not moe_layer and scope in _MOE_ONLY)
                            for part in _SCOPE_MODULES[scope])


def _preprocess_rows(s, modules: list[str], all_to_all_rows: frozenset[int], host_copy_rows: frozenset[int]
                     ) -> set[int]:
    """The rows of a MoE layer's segment ``s`` that ``moe_preprocess`` captures: the MoE block's own
    ops (its module, not a submodule's) before its first token all-to-all in the forward and the
    recompute, after its last one in the backward, but for the host copies of its token counts."""
    rows = range(s.start, s.stop)
    a2a = [r for r in rows if r in all_to_all_rows]
    if not a2a:
        return set()
    blocks = {m.rsplit(_ROUTER, 1)[0] + ".mlp" for m in (modules[r] for r in rows) if _ROUTER in m}
    window = range(s.start, a2a[0]) if s.phase is not Phase.BACKWARD else range(a2a[-1] + 1, s.stop)
    return {r for r in window if modules[r] in blocks and r not in host_copy_rows}


def graphed_host_ns(host: np.ndarray, modules: list[str], segments, blocks, training: TrainingSpec,
                    launch_ns: float, *, all_to_all_rows: frozenset[int] = frozenset(),
                    host_copy_rows: frozenset[int] = frozenset(), shared_expert_overlap: bool = False) -> np.ndarray:
    """``host`` (per row, every host cost of the row) with the captured rows' cost replaced by one
    graph launch per run of consecutive captured rows of a segment; ``modules`` per row,
    ``all_to_all_rows`` the MoE layers' token all-to-alls, ``host_copy_rows`` the copies of their
    token counts to the host (see the module doc)."""
    host = host.copy()
    scopes = training.cuda_graph_scope
    for s in segments:
        if s.phase is Phase.OPTIMIZER:
            continue
        layer_block = blocks[s.block].kind is BlockKind.LAYER
        moe_layer = any(_ROUTER in modules[r] for r in range(s.start, s.stop))
        preprocess = (_preprocess_rows(s, modules, all_to_all_rows, host_copy_rows)
                      if moe_layer and "moe_preprocess" in scopes and "moe" not in scopes else set())
        inside = False
        for row in range(s.start, s.stop):
            if preprocess and row in host_copy_rows:
                continue  # made after the graph: eager, and no break in the captured region
            in_layer = layer_block or _MTP_LAYER.search(modules[row]) is not None
            captured = row in preprocess or _captures(modules[row], in_layer, scopes, moe_layer, shared_expert_overlap)
            if captured:
                host[row] = 0.0 if inside else launch_ns
            inside = captured
    return host


def captured_apart(training: TrainingSpec) -> bool:
    """Whether the captured parts' saved tensors count in ``max allocated`` only while the graphs are
    captured: TransformerEngine's graphs captured before any eager iteration (no warm-up steps)."""
    return training.cuda_graph_impl is CudaGraphImpl.TRANSFORMER_ENGINE and training.cuda_graph_warmup_steps == 0


def captures_attention(training: TrainingSpec) -> bool:
    """Whether the graphs capture the layers' attention (the whole layer, or the ``attn`` scope)."""
    return graphed(training) and _captures(".self_attention", True, training.cuda_graph_scope)


def captured_saved_nbytes(block: Block, training: TrainingSpec, *, te: bool, fp8: bool = False,
                          quantised_nbytes: float = 1.0) -> int:
    """Bytes one instance of ``block`` keeps for backward per micro-batch inside the captured parts,
    as the stack keeps them (:func:`~vtrain_plugin.cost.activation_offload.kept_by_module`)."""
    if not graphed(training) or block.kind is not BlockKind.LAYER:
        return 0
    kept = kept_by_module(block, te=te, fp8=fp8, quantised_nbytes=quantised_nbytes,
                          unfused_attention=training.unfused_attention)
    return sum(nbytes for module, nbytes in kept.items() if _captures(module, True, training.cuda_graph_scope))


def graph_pool_gib(graph: OpGraph, training: TrainingSpec) -> tuple[float, ...]:
    """Per pipeline rank, the static buffers of its captured layers (see the module doc)."""
    pools = [0.0] * graph.parallel.pipeline_parallel
    if not graphed(training) or not graph.stages:
        return tuple(pools)
    nbytes = graph.dtype.nbytes
    for stage in graph.stages:
        activation = int(np.prod(stage.activation_shape)) if stage.activation_shape else 0
        for block in stage.blocks:
            if block.kind is BlockKind.LAYER or "full_iteration" in training.cuda_graph_scope:
                per_layer = (2 * activation + block.num_parameters) * nbytes
                pools[stage.pipeline_rank] += block.count * per_layer / GIB
    return tuple(pools)

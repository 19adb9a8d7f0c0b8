"""CUDA graphs: the host cost of the captured kernels and the memory of the graphs' static buffers.

A captured region (each transformer layer, or the parts ``training.cuda_graph_scope`` names, or
with ``full_iteration`` every forward and backward) is replayed by one ``cudaGraphLaunch``: its
kernels, collectives and module calls cost the host nothing, the launch costs one kernel launch
(``host_overhead_ns``) before the region's first kernel. Device times are unchanged.

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

import numpy as np

from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, Phase
from vtrain_plugin.cost.activation_offload import kept_by_module
from vtrain_plugin.core.units import GIB
from vtrain_plugin.specs.training import CudaGraphImpl, TrainingSpec

# Module path parts each scope captures (megatron-core's TransformerLayer: the attention part runs
# the input norm, the MLP part the pre-MLP norm; a Mamba layer's mixer and its norm).
_SCOPE_MODULES = {
    "attn": (".self_attention", ".input_layernorm"),
    "mlp": (".mlp", ".pre_mlp_layernorm"),
    "moe": (".mlp", ".pre_mlp_layernorm"),
    "moe_router": (".mlp.router",),
    "moe_preprocess": (".mlp.router", ".mlp.token_dispatcher"),
    "mamba": (".mixer", ".norm"),
}


def graphed(training: TrainingSpec) -> bool:
    return training.cuda_graph_impl is not CudaGraphImpl.NONE


def _captures(module: str, in_layer: bool, scopes: tuple[str, ...]) -> bool:
    if "full_iteration" in scopes:
        return True
    if not scopes:
        return in_layer
    path = module + "."
    return in_layer and any(part + "." in path for scope in scopes for part in _SCOPE_MODULES[scope])


def graphed_host_ns(host: np.ndarray, modules: list[str], segments, blocks, training: TrainingSpec,
                    launch_ns: float) -> np.ndarray:
    """``host`` (per row, every host cost of the row) with the captured rows' cost replaced by one
    graph launch per run of consecutive captured rows of a segment; ``modules`` per row."""
    host = host.copy()
    scopes = training.cuda_graph_scope
    for s in segments:
        if s.phase is Phase.OPTIMIZER:
            continue
        in_layer = blocks[s.block].kind is BlockKind.LAYER
        inside = False
        for row in range(s.start, s.stop):
            captured = _captures(modules[row], in_layer, scopes)
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

"""Turn a flat list of records into blocks: embedding, one folded layer template, head.

Layers are folded only when verified identical: same kernels, shapes, phases, collectives and
module paths (with the layer index removed), in the same order. A layer that differs keeps a block
of its own. A chunk that mixes MoE and dense layers has a template per kind, each counted as many
times as the chunk holds that kind (:func:`fold_layer_kinds`).
A chunk that alternates sliding-window and full-attention layers, or NoPE and RoPE layers, folds
into one template of each kind (:func:`fold_window_kinds`, :func:`fold_nope_kinds`), counted from the
stage's layer numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from vtrain_plugin.core.graph import (Block, BlockKind, CollectiveNode, Node, OpNode, ParallelGroup)
from megatron_adapters.conventions import (EMBEDDING, SHARED_BY_CORE_ATTENTION, is_core_attention_module,
                                          is_embedding_module, is_head_module, split_layer_module,
                                          traced_nope_layers)
from vtrain_plugin.core.errors import TraceError
from vtrain_plugin.capture.records import OpRecord, Record


def layer_index(module: str) -> int | None:
    layer = split_layer_module(module)
    return layer[1] if layer else None


def block_of(module: str) -> tuple[BlockKind, str]:
    """Which block a module belongs to, and the block's name."""
    layer = split_layer_module(module)
    if layer:
        prefix, index, _ = layer
        return BlockKind.LAYER, f"{prefix}.{index}"
    if is_embedding_module(module):
        return BlockKind.EMBEDDING, EMBEDDING
    if is_head_module(module):
        return BlockKind.HEAD, "head"
    if module == SHARED_BY_CORE_ATTENTION:
        return BlockKind.STAGE, SHARED_BY_CORE_ATTENTION
    return BlockKind.STAGE, "stage"


def to_node(record: Record, group_of: Callable[[str], ParallelGroup]) -> Node:
    if isinstance(record, OpRecord):
        return OpNode(key=record.key, phase=record.phase, module=record.module,
                      output_shapes=record.output_shapes, launches_kernel=record.launches_kernel,
                      flops=record.flops, nbytes=record.nbytes)
    return CollectiveNode(kind=record.kind, nbytes=record.nbytes, group=group_of(record.group_name),
                          group_size=record.group_size, phase=record.phase, module=record.module,
                          dtype=record.dtype)


def split_blocks(nodes: Sequence[Node], saved_nbytes: Mapping[str, int] | None = None) -> list[Block]:
    """Group nodes by block, keeping each block's nodes in execution order; ``saved_nbytes`` (per
    module) gives each block its activation memory, summed and module by module (the recorder has
    attributed the saves of activation checkpointing to the layers whose inputs they are; a block
    that only keeps activations, such as the stage holding the attention mask, is a block without
    nodes)."""
    saved = saved_nbytes or {}
    by_module: dict[tuple[BlockKind, str], list[tuple[str, int]]] = {}
    for module, nbytes in saved.items():
        by_module.setdefault(block_of(module), []).append((module, nbytes))
    activation = {where: sum(n for _, n in pairs) for where, pairs in by_module.items()}
    order: list[tuple[BlockKind, str]] = []
    members: dict[tuple[BlockKind, str], list[Node]] = {}
    for node in nodes:
        where = block_of(node.module)
        if where not in members:
            members[where] = []
            order.append(where)
        members[where].append(node)
    for where, nbytes in activation.items():
        if where not in members and nbytes:
            members[where] = []
            order.append(where)
    rank = {BlockKind.EMBEDDING: 0, BlockKind.STAGE: 1, BlockKind.LAYER: 2, BlockKind.HEAD: 3}
    order.sort(key=lambda w: (rank[w[0]], layer_index(w[1]) or 0))
    return [Block(kind=k, name=n, nodes=tuple(members[(k, n)]), activation_nbytes=activation.get((k, n), 0),
                  saved_by_module=tuple(by_module.get((k, n), ()))) for k, n in order]


def _signature(block: Block) -> tuple:
    def strip(module: str) -> str:
        layer = split_layer_module(module)
        return layer[2] if layer else module
    sig = []
    for n in block.nodes:
        if isinstance(n, OpNode):
            # Ops that launch no kernel (a scratch buffer allocated by the first layer only) cost
            # nothing and do not make two layers different.
            if n.launches_kernel:
                sig.append((n.key, n.phase, strip(n.module), n.output_shapes))
        else:
            sig.append((n.kind, n.nbytes, n.group, n.group_size, n.phase, strip(n.module)))
    return tuple(sig)


def fold_layers(blocks: Sequence[Block], total_layers: int) -> list[Block]:
    """Fold identical consecutive layer blocks into the first, and scale to ``total_layers``.

    ``blocks`` holds the traced layers (a prefix of the chunk's layers, all built from one spec, or
    one layer when ``total_layers`` is 0: then no layer block is kept);
    the folded template's count becomes ``total_layers``. If the traced layers are not identical
    they are kept apart and the last one stands for the untraced rest.
    """
    layers = [b for b in blocks if b.kind is BlockKind.LAYER]
    others_before = [b for b in blocks if b.kind in (BlockKind.EMBEDDING, BlockKind.STAGE)]
    others_after = [b for b in blocks if b.kind is BlockKind.HEAD]
    if not layers:
        return list(blocks)
    groups: list[list[Block]] = [[layers[0]]]
    for b in layers[1:]:
        if _signature(b) == _signature(groups[-1][0]):
            groups[-1].append(b)
        else:
            groups.append([b])
    folded = [replace(g[0], count=len(g)) for g in groups]
    folded[-1] = replace(folded[-1], count=folded[-1].count + total_layers - len(layers))
    if total_layers == 0:  # a chunk of the embedding or the loss alone, traced with one layer
        folded = []
    return others_before + folded + others_after


def fold_layer_kinds(blocks: Sequence[Block], kinds: Sequence[bool]) -> list[Block]:
    """Fold the traced layers of a chunk whose layers are ``kinds`` (True: MoE, False: dense).

    The traced layers are ``kinds`` themselves (every layer built) or one or more layers of each kind
    present, dense ones first (:func:`vtrain_plugin.capture.tracer._built_kinds`); those of one kind
    are folded as :func:`fold_layers` folds a chunk's layers, to as many as the chunk holds of it.
    """
    layers = [b for b in blocks if b.kind is BlockKind.LAYER]
    others_before = [b for b in blocks if b.kind in (BlockKind.EMBEDDING, BlockKind.STAGE)]
    others_after = [b for b in blocks if b.kind is BlockKind.HEAD]
    if not kinds:  # a chunk of the embedding or the loss alone, traced with one layer
        return others_before + others_after
    if len(layers) == len(kinds):
        built = list(kinds)
    else:
        present = sorted(set(kinds))
        built = [layer_kind for layer_kind in present for _ in range(len(layers) // len(present))]
    folded: list[Block] = []
    for kind in dict.fromkeys(built):
        of_kind = [b for b, k in zip(layers, built, strict=True) if k == kind]
        folded.extend(fold_layers(of_kind, sum(1 for k in kinds if k == kind)))
    return others_before + folded + others_after


def fold_hybrid_layers(blocks: Sequence[Block], kinds: str, pattern: str) -> list[Block]:
    """A hybrid chunk's blocks for a stage of ``pattern``: traced layer ``i`` is of kind ``kinds[i]``
    (one of each kind, :func:`vtrain_plugin.specs.hybrid.traced_kinds`), and becomes the template of
    its kind, counted as often as ``pattern`` has that kind; a kind the stage lacks is dropped."""
    layers = [b for b in blocks if b.kind is BlockKind.LAYER]
    if len(layers) != len(kinds):
        raise AssertionError(f"traced {len(layers)} layers for the {len(kinds)} layer kinds {kinds!r}")
    folded = [replace(b, count=pattern.count(kind)) for b, kind in zip(layers, kinds) if kind in pattern]
    return ([b for b in blocks if b.kind in (BlockKind.EMBEDDING, BlockKind.STAGE)] + folded
            + [b for b in blocks if b.kind is BlockKind.HEAD])


def layers_identical(blocks: Sequence[Block]) -> bool:
    layers = [b for b in blocks if b.kind is BlockKind.LAYER]
    return all(_signature(b) == _signature(layers[0]) for b in layers[1:])


WINDOW_MASK_OP = "aten.triu.default"  # the sliding-window mask a windowed layer builds at every forward


def is_windowed(block: Block) -> bool:
    """Whether a traced layer block has sliding-window attention: its core attention builds the
    window's mask (:func:`megatron_adapters.stand_ins.sliding_window_causal_mask`) in forward."""
    return any(isinstance(n, OpNode) and n.key.op == WINDOW_MASK_OP and is_core_attention_module(n.module)
               for n in block.nodes)


MTP_LAYER = "mtp.layers.0"  # the first multi-token-prediction layer, in the head block (its others alike)


def layer_kind(block: Block, *, nope_possible: bool = False) -> str:
    """What kind of layer a folded layer block is, from the modules its ops ran in: ``Mamba`` (a
    hybrid's mixer), ``MoE`` (a router), ``attention`` or ``MLP`` (a hybrid's layers of one part),
    else ``dense``; with `` window`` when its core attention builds a sliding-window mask, and
    `` NoPE`` when ``nope_possible`` (the model has NoPE layers) and no rotary embedding ran in its
    self-attention. An MTP layer (:data:`MTP_LAYER`, in the head) is ``MTP`` plus its layer's kind."""
    modules = {n.module for n in block.nodes}

    def has(part: str) -> bool:
        return any(part in m for m in modules)

    if has(".mixer"):
        kind = "Mamba"
    elif has(".mlp.router"):
        kind = "MoE"
    elif has(".self_attention") != has(".mlp"):
        kind = "attention" if has(".self_attention") else "MLP"
    else:
        kind = "dense"
    if is_windowed(block):
        kind += " window"
    if nope_possible and has(".self_attention") and not any(
            isinstance(n, OpNode) and n.key.op == ROTARY_OP and ".self_attention" in n.module for n in block.nodes):
        kind += " NoPE"
    return kind


ROTARY_OP = "aten.cos.default"  # the local spec's unfused RoPE takes the cosine of the frequencies per layer


def mtp_layer(head: Block) -> Block | None:
    """The first MTP layer's ops of a head block, as a block of their own (None without MTP)."""
    nodes = tuple(n for n in head.nodes if n.module == MTP_LAYER or n.module.startswith(MTP_LAYER + "."))
    return replace(head, name=MTP_LAYER, nodes=nodes) if nodes else None


def fold_window_kinds(blocks: Sequence[Block], total_layers: int, windowed: int) -> list[Block]:
    """Fold the traced layers of a chunk that alternates windowed and full-attention layers into one
    template of each kind, counted ``windowed`` and ``total_layers - windowed``; a kind with no layer in
    this chunk is left out. The traced layers of each kind must be identical."""
    return _fold_two_kinds(blocks, total_layers, windowed, [is_windowed(b) for b in _layers(blocks)],
                           ("windowed", "full-attention"))


def fold_nope_kinds(blocks: Sequence[Block], total_layers: int, nope: int) -> list[Block]:
    """Fold the traced layers of a chunk that mixes NoPE and RoPE layers (built as
    :func:`~megatron_adapters.conventions.traced_nope_layers` says) into one template of each kind,
    counted ``nope`` and ``total_layers - nope``, as :func:`fold_window_kinds` does."""
    traced = _layers(blocks)
    return _fold_two_kinds(blocks, total_layers, nope, list(traced_nope_layers(len(traced), True)), ("NoPE", "RoPE"))


def _layers(blocks: Sequence[Block]) -> list[Block]:
    return [b for b in blocks if b.kind is BlockKind.LAYER]


def _fold_two_kinds(blocks: Sequence[Block], total_layers: int, count: int, is_kind: list[bool],
                    names: tuple[str, str]) -> list[Block]:
    """The traced layers (``is_kind``: whether each is of the first kind) folded into one template of
    each kind, counted ``count`` and ``total_layers - count``; a kind without layers left out."""
    layers = _layers(blocks)
    others_before = [b for b in blocks if b.kind in (BlockKind.EMBEDDING, BlockKind.STAGE)]
    others_after = [b for b in blocks if b.kind is BlockKind.HEAD]
    kinds: dict[bool, list[Block]] = {}
    for b, kind in zip(layers, is_kind, strict=True):
        kinds.setdefault(kind, []).append(b)
    if set(kinds) != {True, False}:
        raise TraceError(f"a chunk of {names[0]} and {names[1]} layers traced {len(layers)} layer(s) of one kind")
    for kind, group in kinds.items():
        if any(_signature(b) != _signature(group[0]) for b in group[1:]):
            raise TraceError(f"the traced {names[0] if kind else names[1]} layers differ")
    counts = {True: count, False: total_layers - count}
    folded = [replace(kinds[kind][0], count=counts[kind]) for kind in (True, False) if counts[kind]]
    return others_before + folded + others_after

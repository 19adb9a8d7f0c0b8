"""A chunk trace's blocks packed as tables: each distinct node, kernel key, shape and string stored once.

:func:`pack_blocks` turns blocks into plain data (lists, ints, strings: what ``marshal`` writes) in
columns, one list per field, with a block's nodes as indices into the node tables; :func:`unpack_blocks`
builds each distinct kernel key and node once and shares it among the blocks that hold it (they are
frozen, so sharing is safe).
Why: a traced chunk repeats its nodes (the built layers, forward and recompute) and kernel keys many
times; building one object per stored node was most of reading a trace-cache entry.
"""

from __future__ import annotations

import json

from collections.abc import Hashable, Sequence
from typing import Any

from vtrain_plugin.core.graph import (Block, BlockKind, CollectiveKind, CollectiveNode, KernelKey, Node, OpNode,
                                      ParallelGroup, Phase, member)

_BLOCK_FIELDS = ("kind", "name", "count", "activation_nbytes", "num_parameters")


class _Table:
    """Distinct values in order of first appearance, each with its index."""

    def __init__(self) -> None:
        self.index: dict[Hashable, int] = {}

    def add(self, value: Hashable) -> int:
        return self.index.setdefault(value, len(self.index))

    @property
    def values(self) -> list:
        return list(self.index)


def pack_blocks(blocks: Sequence[Block]) -> dict[str, Any]:
    """``blocks`` as plain-data tables (:func:`unpack_blocks` reads them back equal)."""
    strings, shapes, shape_lists, dtype_lists, arg_lists = _Table(), _Table(), _Table(), _Table(), _Table()
    keys, ops, collectives = _Table(), _Table(), _Table()

    known_shape_lists: dict[tuple[tuple[int, ...], ...], int] = {}  # most nodes repeat another's shapes

    def shape_list(value: tuple[tuple[int, ...], ...]) -> int:
        index = known_shape_lists.get(value)
        if index is None:
            index = known_shape_lists[value] = shape_lists.add(tuple(shapes.add(s) for s in value))
        return index

    packed_blocks = []
    for block in blocks:
        refs = []
        for node in block.nodes:
            if isinstance(node, OpNode):
                key = node.key
                args = [[name, _listed(a)] for name, a in key.args]
                # by their JSON: 1, 1.0 and True are equal in Python, not as arguments
                k = keys.add((strings.add(key.op), shape_list(key.input_shapes), dtype_lists.add(key.dtypes),
                              arg_lists.add(json.dumps(args))))
                refs.append(ops.add((k, node.phase.value, strings.add(node.module), shape_list(node.output_shapes),
                                     node.launches_kernel, node.flops, node.nbytes)))
            else:
                refs.append(~collectives.add((node.kind.value, node.nbytes, node.group.value, node.group_size,
                                              node.phase.value, strings.add(node.module), node.dtype,
                                              node.synthesized)))
        packed_blocks.append({**{f: getattr(block, f) for f in _BLOCK_FIELDS}, "kind": block.kind.value,
                              "saved_by_module": [[m, n] for m, n in block.saved_by_module],
                              "parameter_numels": list(block.parameter_numels),
                              "expert_parameter_numels": list(block.expert_parameter_numels), "nodes": refs})
    return {"strings": strings.values, "shapes": [list(s) for s in shapes.values],
            "shape_lists": [list(s) for s in shape_lists.values], "dtype_lists": [list(d) for d in dtype_lists.values],
            "arg_lists": [json.loads(args) for args in arg_lists.values],
            "keys": _columns(keys.values, 4), "ops": _columns(ops.values, 7),
            "collectives": _columns(collectives.values, 8), "blocks": packed_blocks}


class SharedNodes:
    """Kernel keys, nodes and blocks' node tuples already built by :func:`unpack_blocks`, each by its
    plain-data content, for the next tables read to take instead of building equal ones.

    Why: the trace-cache entries of one plan shape (its first, middle and last stages, each number of
    layers built) hold the same layers; read with one of these, equal layers come back as one node
    tuple, so the costing, which keeps a block's lowering per node tuple (by identity), lowers each
    once, and most nodes of an entry are looked up, not built. The content is the stored form's,
    arguments by their ``repr`` (1, 1.0 and True apart); a node is keyed by its kernel key's identity
    and a node tuple by its nodes', so everything is held until :meth:`clear`, which empties all at
    once (as ``limit`` nodes are exceeded) so that no identity outlives its object."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self.keys: dict[tuple, KernelKey] = {}
        self.nodes: dict[tuple, OpNode] = {}
        self.collectives: dict[tuple, CollectiveNode] = {}
        self.tuples: dict[tuple, tuple[Node, ...]] = {}

    def clear(self) -> None:
        self.keys.clear(), self.nodes.clear(), self.collectives.clear(), self.tuples.clear()


def unpack_blocks(d: dict[str, Any], shared: SharedNodes | None = None) -> tuple[Block, ...]:
    """The blocks of :func:`pack_blocks`'s tables; equal kernel keys, nodes and node tuples taken from
    ``shared`` (and added to it) when given."""
    strings = d["strings"]
    shapes = [tuple(s) for s in d["shapes"]]
    shape_lists = [tuple(shapes[i] for i in s) for s in d["shape_lists"]]
    dtype_lists = [tuple(x) for x in d["dtype_lists"]]
    if shared is None:
        arg_lists = [tuple((name, _tupled(a)) for name, a in args) for args in d["arg_lists"]]
        keys = [KernelKey(op=strings[op], input_shapes=shape_lists[inputs], dtypes=dtype_lists[dtypes],
                          args=arg_lists[args]) for op, inputs, dtypes, args in zip(*d["keys"], strict=True)]
        ops = [OpNode(key=keys[k], phase=member(Phase, phase), module=strings[module],
                      output_shapes=shape_lists[out], launches_kernel=launches, flops=flops, nbytes=nbytes)
               for k, phase, module, out, launches, flops, nbytes in zip(*d["ops"], strict=True)]
        collectives = [_collective(*c[:5], strings[c[5]], *c[6:]) for c in zip(*d["collectives"], strict=True)]
    else:
        if len(shared.nodes) > shared.limit:
            shared.clear()
        arg_texts = [repr(args) for args in d["arg_lists"]]
        keys = []
        for op, inputs, dtypes, args in zip(*d["keys"], strict=True):
            content = (strings[op], shape_lists[inputs], dtype_lists[dtypes], arg_texts[args])
            key = shared.keys.get(content)
            if key is None:
                key = shared.keys[content] = KernelKey(
                    op=content[0], input_shapes=content[1], dtypes=content[2],
                    args=tuple((name, _tupled(a)) for name, a in d["arg_lists"][args]))
            keys.append(key)
        ops = []
        for k, phase, module, out, launches, flops, nbytes in zip(*d["ops"], strict=True):
            content = (id(keys[k]), phase, strings[module], shape_lists[out], launches, flops, nbytes)
            node = shared.nodes.get(content)
            if node is None:
                node = shared.nodes[content] = OpNode(
                    key=keys[k], phase=member(Phase, phase), module=content[2], output_shapes=content[3],
                    launches_kernel=launches, flops=flops, nbytes=nbytes)
            ops.append(node)
        collectives = []
        for c in zip(*d["collectives"], strict=True):
            content = (*c[:5], strings[c[5]], *c[6:])
            node = shared.collectives.get(content)
            if node is None:
                node = shared.collectives[content] = _collective(*content)
            collectives.append(node)
    blocks = []
    for b in d["blocks"]:
        nodes = _nodes(b["nodes"], ops, collectives)
        if shared is not None:
            nodes = shared.tuples.setdefault(tuple(map(id, nodes)), nodes)
        blocks.append(Block(kind=BlockKind(b["kind"]), name=b["name"], count=b["count"],
                            activation_nbytes=b["activation_nbytes"], num_parameters=b["num_parameters"],
                            saved_by_module=tuple((str(m), int(n)) for m, n in b["saved_by_module"]),
                            parameter_numels=tuple(b["parameter_numels"]),
                            expert_parameter_numels=tuple(b["expert_parameter_numels"]), nodes=nodes))
    return tuple(blocks)


def _collective(kind: str, nbytes: int, group: str, size: int, phase: str, module: str, dtype: str,
                synthesized: bool) -> CollectiveNode:
    return CollectiveNode(kind=member(CollectiveKind, kind), nbytes=nbytes, group=member(ParallelGroup, group),
                          group_size=size, phase=member(Phase, phase), module=module, dtype=dtype,
                          synthesized=synthesized)


def _nodes(refs: Sequence[int], ops: list[OpNode], collectives: list[CollectiveNode]) -> tuple[Node, ...]:
    return tuple(ops[i] if i >= 0 else collectives[~i] for i in refs)


def _columns(rows: list[tuple], width: int) -> list[list]:
    """Rows of ``width`` fields as one list per field (empty lists when there are no rows)."""
    return [list(column) for column in zip(*rows)] if rows else [[] for _ in range(width)]


def _listed(a: Any) -> Any:
    return [_listed(x) for x in a] if isinstance(a, tuple) else a


def _tupled(a: Any) -> Any:
    return tuple(_tupled(x) for x in a) if isinstance(a, list) else a

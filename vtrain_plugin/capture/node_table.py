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


def unpack_blocks(d: dict[str, Any]) -> tuple[Block, ...]:
    """The blocks of :func:`pack_blocks`'s tables."""
    strings = d["strings"]
    shapes = [tuple(s) for s in d["shapes"]]
    shape_lists = [tuple(shapes[i] for i in s) for s in d["shape_lists"]]
    dtype_lists = [tuple(x) for x in d["dtype_lists"]]
    arg_lists = [tuple((name, _tupled(a)) for name, a in args) for args in d["arg_lists"]]
    keys = [KernelKey(op=strings[op], input_shapes=shape_lists[inputs], dtypes=dtype_lists[dtypes],
                      args=arg_lists[args]) for op, inputs, dtypes, args in zip(*d["keys"], strict=True)]
    ops = [OpNode(key=keys[k], phase=member(Phase, phase), module=strings[module], output_shapes=shape_lists[out],
                  launches_kernel=launches, flops=flops, nbytes=nbytes)
           for k, phase, module, out, launches, flops, nbytes in zip(*d["ops"], strict=True)]
    collectives = [CollectiveNode(kind=member(CollectiveKind, kind), nbytes=nbytes, group=member(ParallelGroup, group),
                                  group_size=size, phase=member(Phase, phase), module=strings[module], dtype=dtype,
                                  synthesized=synthesized)
                   for kind, nbytes, group, size, phase, module, dtype, synthesized in zip(*d["collectives"],
                                                                                           strict=True)]
    return tuple(Block(kind=BlockKind(b["kind"]), name=b["name"], count=b["count"],
                       activation_nbytes=b["activation_nbytes"], num_parameters=b["num_parameters"],
                       saved_by_module=tuple((str(m), int(n)) for m, n in b["saved_by_module"]),
                       parameter_numels=tuple(b["parameter_numels"]),
                       expert_parameter_numels=tuple(b["expert_parameter_numels"]),
                       nodes=_nodes(b["nodes"], ops, collectives)) for b in d["blocks"])


def _nodes(refs: Sequence[int], ops: list[OpNode], collectives: list[CollectiveNode]) -> tuple[Node, ...]:
    return tuple(ops[i] if i >= 0 else collectives[~i] for i in refs)


def _columns(rows: list[tuple], width: int) -> list[list]:
    """Rows of ``width`` fields as one list per field (empty lists when there are no rows)."""
    return [list(column) for column in zip(*rows)] if rows else [[] for _ in range(width)]


def _listed(a: Any) -> Any:
    return [_listed(x) for x in a] if isinstance(a, tuple) else a


def _tupled(a: Any) -> Any:
    return tuple(_tupled(x) for x in a) if isinstance(a, list) else a

"""Chunk traces packed as tables: real megatron-core chunks read back equal, each distinct node built once."""

import gzip
import json
import marshal

import pytest

from vtrain_plugin.capture import disk_cache
from vtrain_plugin.capture.chunk import ChunkTrace, shape_key
from vtrain_plugin.capture.megatron_chunk import trace_chunk
from vtrain_plugin.capture.node_table import SharedNodes, pack_blocks, unpack_blocks
from vtrain_plugin.core.graph import Block, BlockKind, CollectiveNode, KernelKey, OpNode, Phase
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

DENSE = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128,
                num_experts=4, dtype="bf16")


@pytest.fixture(scope="module", params=[(DENSE, ParallelPlan(tensor_parallel=2, recompute="full")),
                                        (MOE, ParallelPlan(tensor_parallel=2, sequence_parallel=True, data_parallel=2,
                                                           expert_parallel=2))],
                ids=["dense-recompute", "moe-ep"])
def chunk(request) -> ChunkTrace:
    model, plan = request.param
    return trace_chunk(model, plan, True, True, 2)


def test_tables_read_back_equal_through_marshal(chunk):
    stored = marshal.loads(marshal.dumps(chunk.to_tables()))
    assert ChunkTrace.from_tables(stored) == chunk
    assert ChunkTrace.from_tables(stored).to_dict() == chunk.to_dict()


def test_each_distinct_node_and_kernel_key_is_built_once(chunk):
    blocks = unpack_blocks(pack_blocks(chunk.blocks))
    nodes = [n for b in blocks for n in b.nodes]
    assert len({id(n) for n in nodes}) == len(set(nodes)) < len(nodes)  # the built layers repeat their nodes
    keys = [n.key for n in nodes if not isinstance(n, CollectiveNode)]
    assert len({id(k) for k in keys}) == len(set(keys))
    assert any(isinstance(n, CollectiveNode) for n in nodes)  # TP collectives packed too


def test_arguments_equal_in_python_keep_their_types():
    # 1, 1.0 and True compare equal: packing must not merge the kernel keys that hold them
    ops = tuple(OpNode(key=KernelKey(op="aten.add.Tensor", input_shapes=((2,),), dtypes=("float32",),
                                     args=(("alpha", value),)), phase=Phase.FORWARD, module="m")
                for value in (1, 1.0, True))
    block = Block(kind=BlockKind.STAGE, name="stage", nodes=ops)
    (read,) = unpack_blocks(marshal.loads(marshal.dumps(pack_blocks((block,)))))
    assert [type(dict(n.key.args)["alpha"]) for n in read.nodes] == [int, float, bool]


def test_tables_read_with_shared_nodes_read_back_equal_and_share_equal_layers(chunk):
    stored = marshal.loads(marshal.dumps(chunk.to_tables()))
    shared = SharedNodes()
    first, second = ChunkTrace.from_tables(stored, shared), ChunkTrace.from_tables(stored, shared)
    assert first == second == chunk and first.to_dict() == chunk.to_dict()
    assert all(a.nodes is b.nodes for a, b in zip(first.blocks, second.blocks))  # one tuple per equal layer
    layers = [b.nodes for b in first.blocks if b.kind is BlockKind.LAYER]
    assert len(layers) == 2 and (layers[0] is layers[1]) == (layers[0] == layers[1])
    plain = ChunkTrace.from_tables(stored)
    assert all(a.nodes is not b.nodes for a, b in zip(plain.blocks, first.blocks) if a.nodes)  # no sharing unless asked


def test_shared_nodes_keep_arguments_equal_in_python_apart():
    def block(value) -> Block:
        return Block(kind=BlockKind.STAGE, name="stage", nodes=(OpNode(
            key=KernelKey(op="aten.add.Tensor", input_shapes=((2,),), dtypes=("float32",), args=(("alpha", value),)),
            phase=Phase.FORWARD, module="m"),))

    shared = SharedNodes()
    read = [unpack_blocks(marshal.loads(marshal.dumps(pack_blocks((block(v),)))), shared)[0] for v in (1, 1.0, True, 1)]
    assert [type(dict(b.nodes[0].key.args)["alpha"]) for b in read] == [int, float, bool, int]
    assert read[3].nodes is read[0].nodes and len({id(b.nodes) for b in read}) == 3


def test_shared_nodes_start_over_above_their_limit(chunk):
    stored = marshal.loads(marshal.dumps(chunk.to_tables()))
    shared = SharedNodes(limit=1)
    first = ChunkTrace.from_tables(stored, shared)
    second = ChunkTrace.from_tables(stored, shared)  # emptied first: built again
    assert second == first and all(a.nodes is not b.nodes for a, b in zip(first.blocks, second.blocks) if a.nodes)
    assert len(shared.tuples) == len({id(b.nodes) for b in second.blocks})


def test_an_entry_of_the_former_format_under_this_key_is_ignored(chunk, tmp_path, monkeypatch):
    # blocks as node dicts (entry format 3) where tables are expected: not read, so traced again
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path))
    key = shape_key(DENSE, ParallelPlan(), True, True, 2)
    disk_cache.store(key, chunk)
    assert disk_cache.load(key) == chunk
    path = disk_cache.entry_path(key)
    path.write_bytes(gzip.compress(marshal.dumps(json.loads(json.dumps(
        {"key": disk_cache.entry_key(key), "chunk": chunk.to_dict()})))))
    assert disk_cache.load(key) is None

"""Muon under the distributed optimizer (megatron-core's LayerWiseDistributedOptimizer) on a small
real megatron-core MoE traced on the fake process group: whole parameters dealt to the DP ranks in
increasing size, ping-pong; the busiest rank's state is the memory's."""

from __future__ import annotations

import pytest

from vtrain_plugin import estimate
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.memory import layer_wise_optimizer_nbytes
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

H, VOCAB = 64, 256
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=VOCAB,
                dtype="bf16", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=H)
PLAN = ParallelPlan(expert_parallel=2, data_parallel=2, micro_batch_size=2)  # DP 2, expert DP 1
ADAM, MATRIX = 12, 8  # bytes per element: fp32 main weight and two moments; fp32 main weight and momentum


@pytest.fixture(scope="module")
def moe():
    from vtrain_plugin.capture.tracer import trace

    return trace(MOE, PLAN)


def test_parameters_are_dealt_whole_in_increasing_size(moe):
    # dense, sorted: five norms of 64 (Adam), two routers of 4 x 64, two projections of 64 x 64, two
    # QKV of 192 x 64 (Muon), the embedding and the output layer of 256 x 64 (Adam), dealt to ranks
    # 0 1 1 0 | 0 1 1 0 | 0 1 1 0 | 0: rank 0 holds three norms, both projections and both 256 x 64
    rank0 = (3 * H + 2 * VOCAB * H) * ADAM + 2 * H * H * MATRIX
    rank1 = 2 * H * ADAM + (2 * 4 * H + 2 * 3 * H * H) * MATRIX
    assert rank0 > rank1
    experts = 2 * 2 * (2 * H * H + H * H) * MATRIX  # expert DP 1: both layers' two local experts, fc1 and fc2
    assert layer_wise_optimizer_nbytes(moe.stages, ADAM, MATRIX, PLAN) == rank0 + experts


def test_the_estimate_holds_the_busiest_ranks_state(moe):
    def optimizer_gib(kind: str, distributed: bool) -> float:
        training = TrainingSpec(global_batch_size=4, optimizer=OptimizerSpec(kind=kind),
                                distributed_optimizer=distributed)
        return estimate(moe, cluster=cluster_for_gpu("h100"), training=training, profile_db=False
                        ).memory_gib[0].optimizer_gib

    assert optimizer_gib("muon", True) * GIB == layer_wise_optimizer_nbytes(moe.stages, ADAM, MATRIX, PLAN)
    # without the distributed optimizer every rank holds the state of all its parameters
    whole = (5 * H + 2 * VOCAB * H) * ADAM + (2 * 4 * H + 2 * H * H + 2 * 3 * H * H + 2 * 2 * 3 * H * H) * MATRIX
    assert optimizer_gib("muon", False) * GIB == whole

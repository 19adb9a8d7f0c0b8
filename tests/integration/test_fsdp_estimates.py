"""FSDP on a real traced Llama: memory per sharding strategy against Megatron-FSDP's own buffers, and
the direction its communication moves the iteration time.

Megatron-FSDP's accounting, re-derived from megatron-core 0.16's
``ParamAndGradBuffer._init_each_parameter_group_buffers`` (``megatron_fsdp/param_and_grad_buffer.py``):
per parameter, a model-weight buffer in the model dtype (bf16: 2 bytes), sharded over the DP group
only by ``optim_grads_params``; a main-grad buffer in fp32 (``grad_reduce_in_fp32``, Megatron-LM's
default for bf16: 4 bytes), sharded by ``optim_grads`` and ``optim_grads_params``; an fp32 main-weight
buffer (4 bytes) and Adam's two fp32 moments on its shard (8 bytes), sharded by every strategy but
``no_shard``. With ``fsdp_double_buffer`` two fixed buffers hold the gathered weights of two units
and two the unsharded gradients (``FixedPoolAllocator(size=2)``); the units are the blocks of the
model in forward order: embedding, the layers, the output layer (with the final norm).
"""

import json

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

GIB = 2**30
DP = 8
MODEL = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=128, vocab_size=1000, dtype="bf16")
CLUSTER = get_cluster_preset("dgx-h100")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, ParallelPlan(data_parallel=DP, micro_batch_size=1))


def run(graph, fsdp=None, **training):
    return estimate(graph, cluster=CLUSTER, training=TrainingSpec(global_batch_size=4 * DP, grad_reduce="overlap",
                                                                  fsdp=fsdp, **training))


def unit_numels() -> list[int]:
    """Parameters of each FSDP unit of the Llama above (no biases, RMSNorm), from its dimensions."""
    h, heads, groups = MODEL.hidden_size, MODEL.num_attention_heads, MODEL.query_groups
    head_dim, ffn, vocab = h // heads, MODEL.ffn_size, MODEL.padded_vocab_size(1)
    layer = 2 * h + h * (heads + 2 * groups) * head_dim + heads * head_dim * h + 3 * h * ffn
    return [vocab * h] + [layer] * MODEL.num_layers + [vocab * h + h]


def megatron_fsdp_bytes(strategy: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU by Megatron-FSDP's buffers, double-buffered."""
    units = unit_numels()
    p = sum(units)
    pair = max(a + b for a, b in zip(units, units[1:]))  # the two units of the fixed pool, at most
    weights = 2 * p / DP + 2 * pair if strategy == "optim_grads_params" else 2 * p
    grads = 4 * p / DP + 4 * pair if strategy in ("optim_grads", "optim_grads_params") else 4 * p
    optimizer = 12 * p / DP if strategy != "no_shard" else 12 * p
    return weights, grads, optimizer


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_per_strategy_is_megatron_fsdps(graph, strategy):
    (memory,) = run(graph, {"sharding_strategy": strategy, "double_buffer": True}).memory_gib
    expected = megatron_fsdp_bytes(strategy)
    assert (memory.weights_gib * GIB, memory.gradients_gib * GIB, memory.optimizer_gib * GIB) == \
        pytest.approx(expected, rel=1e-12)
    assert sum(unit_numels()) == graph.stages[0].num_parameters  # the trace holds the derived parameters


def test_sharding_more_saves_memory_on_8_gpus(graph):
    totals = [run(graph, {"sharding_strategy": s, "double_buffer": True}).memory_gib[0].total_gib
              for s in STRATEGIES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    # ZeRO-1 by Megatron-FSDP is the distributed optimizer's memory
    assert run(graph, {"sharding_strategy": "optim"}).memory_gib == run(graph, distributed_optimizer=True).memory_gib


def test_without_double_buffer_a_small_model_is_gathered_whole(graph):
    """Megatron-FSDP prefetches 5e8 elements and queues 1e9 gradient elements by default: every unit
    of a 3.5M-parameter model at once. The unsharded gradients are allocated while the backward frees
    the micro-batch's stash, so at the peak they add what they exceed it by (PP 1, one micro-batch in
    flight: the stash and the step's transient are the activations)."""
    (memory,) = run(graph, {"sharding_strategy": "optim_grads_params"}).memory_gib
    p = sum(unit_numels())
    assert memory.weights_gib * GIB == pytest.approx(2 * p / DP + 2 * p, rel=1e-12)
    freed = memory.activations_gib * GIB
    assert 0 < freed < 4 * p
    assert memory.gradients_gib * GIB == pytest.approx(4 * p / DP + 4 * p - freed, rel=1e-12)
    (small,) = run(graph, {"sharding_strategy": "optim_grads_params",
                           "communication_unit_elements": max(unit_numels())}).memory_gib
    assert small.weights_gib < memory.weights_gib and small.gradients_gib < memory.gradients_gib


def test_fsdp_adds_communication_when_compute_is_tiny(graph):
    # against the distributed optimizer: both copy only the rank's shard of the main weights, where
    # plain DDP copies every parameter each step (host work that can outweigh FSDP's extra gathers)
    ddp = run(graph, distributed_optimizer=True)
    fsdp = run(graph, {"sharding_strategy": "optim_grads_params", "double_buffer": True})
    zero2 = run(graph, {"sharding_strategy": "optim_grads", "double_buffer": True})
    assert fsdp.breakdown_ms["dp_comm"] > zero2.breakdown_ms["dp_comm"] > 0
    assert fsdp.breakdown_ms["dp_comm"] > ddp.breakdown_ms["dp_comm"]
    assert fsdp.iteration_time_ms > ddp.iteration_time_ms
    # compute is the same: the collectives are reported apart
    assert fsdp.breakdown_ms["forward"] == pytest.approx(ddp.breakdown_ms["forward"], rel=1e-9)
    assert fsdp.fsdp == "megatron:optim_grads_params:double_buffer" and ddp.fsdp is None
    assert any(line.startswith("FSDP (megatron:optim_grads_params") for line in fsdp.assumptions)


def test_torch_fsdp2_without_reshard_skips_the_backward_gathers_and_keeps_the_weights(graph):
    reshard = run(graph, {"implementation": "torch"})
    kept = run(graph, {"implementation": "torch", "reshard_after_forward": False})
    assert kept.breakdown_ms["dp_comm"] < reshard.breakdown_ms["dp_comm"]
    assert kept.memory_gib[0].weights_gib > reshard.memory_gib[0].weights_gib


def test_cli_estimate_of_a_plan_file_with_fsdp(tmp_path, run_cli):
    plan = {"model": {"family": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                      "num_query_groups": 2, "seq_length": 128, "vocab_size": 1000, "dtype": "bf16"},
            "parallel": {"data_parallel": DP},
            "training": {"global_batch_size": 4 * DP, "grad_reduce": "overlap",
                         "fsdp": {"sharding_strategy": "optim_grads_params", "double_buffer": True}},
            "cluster": {"preset": "dgx-h100"}}
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(plan))
    document = json.loads(run_cli("estimate", str(path), "--format", "json", check=True).stdout)
    assert document["fsdp"] == "megatron:optim_grads_params:double_buffer"
    (memory,) = document["memory_gib_per_stage"]
    expected = megatron_fsdp_bytes("optim_grads_params")
    assert [memory[part] * GIB for part in ("weights", "gradients", "optimizer")] == pytest.approx(expected, rel=1e-9)
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps({**plan, "training": {**plan["training"], "fsdp": {"sharding_strategy": "zero3"}}}))
    bad = run_cli("estimate", str(bad_path), check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "training.fsdp.sharding_strategy must be one of" in bad.stderr


def test_bf16_gradient_communication_moves_fewer_bytes_than_fp32(graph):
    """Ablation: --megatron-fsdp-grad-comm-dtype bf16 halves the per-unit reduce-scatter bytes of the
    fp32 main grads: less data-parallel time; memory and compute stay."""
    fp32 = run(graph, {"double_buffer": True, "grad_comm_dtype": "fp32"})
    auto = run(graph, {"double_buffer": True})
    bf16 = run(graph, {"double_buffer": True, "grad_comm_dtype": "bf16"})
    assert fp32.breakdown_ms["dp_comm"] == auto.breakdown_ms["dp_comm"]  # auto: the fp32 main grads
    assert bf16.breakdown_ms["dp_comm"] < fp32.breakdown_ms["dp_comm"]
    assert bf16.memory_gib == fp32.memory_gib
    assert bf16.breakdown_ms["forward"] == pytest.approx(fp32.breakdown_ms["forward"], rel=1e-9)

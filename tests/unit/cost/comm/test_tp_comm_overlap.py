"""TP communication overlap (training.tp_comm_overlap): which GEMM each sequence-parallel all-gather /
reduce-scatter hides behind, and the exact time left exposed, on hand-built layers."""

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, OpNode, ParallelGroup, Phase
from vtrain_plugin.cost.comm.overlap import overlap_partners
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

from tests.support.one_layer_cost import LAYER, cost_one_layer
from tests.support.quiet_host import write_quiet_host_calibration

QKV, PROJ, FC1, FC2 = (f"{LAYER}.{m}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                 "mlp.linear_fc1", "mlp.linear_fc2"))
NBYTES = 8_000_000
PLAN = ParallelPlan(tensor_parallel=8, sequence_parallel=True)


def _gemm(module, phase, m):
    return OpNode(key=KernelKey(op="aten.mm.default", input_shapes=((m, 64), (64, 64)), dtypes=("bfloat16",) * 2),
                  phase=phase, module=module, flops=2 * m * 64 * 64)


def _tp(kind, module, phase):
    return CollectiveNode(kind=kind, nbytes=NBYTES, group=ParallelGroup.TP, group_size=8, phase=phase, module=module)


AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE
F, B = Phase.FORWARD, Phase.BACKWARD


def test_each_collective_pairs_with_the_gemm_it_feeds_or_drains():
    forward = [_tp(AG, QKV, F), _gemm(QKV, F, 1), _gemm(PROJ, F, 2), _tp(RS, PROJ, F), _tp(AG, FC1, F),
               _gemm(FC1, F, 3), _gemm(FC2, F, 4), _tp(RS, FC2, F)]
    # qkv's all-gather feeds its GEMM; proj's reduce-scatter drains the GEMM before it
    assert overlap_partners(forward, in_layer=True) == {0: 1, 3: 2, 4: 5, 7: 6}
    backward = [_tp(AG, FC1, B), _gemm(FC1, B, 5), _tp(RS, FC1, B), _gemm(FC1, B, 6), _tp(AR, FC2, B)]
    # backward: the all-gather feeds the data-gradient GEMM, the reduce-scatter runs beside the
    # weight-gradient GEMM; all-reduces (no SP) never overlap
    assert overlap_partners(backward, in_layer=True) == {0: 1, 2: 3}
    assert overlap_partners(forward, in_layer=False) == {}  # embedding, output layer, loss: not TE's layers


def _cost(gemm_ns: float, *, overlap: bool, plan: ParallelPlan = PLAN):
    gemm = _gemm(QKV, F, 4096)
    chunk, comm = cost_one_layer((_tp(AG, QKV, F), gemm), plan, "local_spec", {gemm.key: gemm_ns}, seq_length=4096,
                                 training=TrainingSpec(global_batch_size=1, tp_comm_overlap=overlap))
    return chunk, comm.time_ns(AG, NBYTES, ParallelGroup.TP)


def test_a_collective_shorter_than_its_gemm_is_hidden():
    chunk, comm_ns = _cost(1e6, overlap=True)
    assert comm_ns < 1e6
    assert chunk.tp_comm_forward_ns == 0.0


def test_a_collective_longer_than_its_gemm_exposes_the_difference():
    chunk, comm_ns = _cost(1000.0, overlap=True)
    assert comm_ns > 1000.0
    assert chunk.tp_comm_forward_ns == comm_ns - 1000.0


def test_without_overlap_the_collective_blocks_for_its_whole_time(monkeypatch, tmp_path):
    # with the eager stack's host costs the all-gather before the GEMM waits behind the host's
    # issue anyway: the least host cost lets the device set the pace
    monkeypatch.setenv("VTRAIN_CALIBRATION_DIR", str(tmp_path))
    write_quiet_host_calibration("h100-sxm")
    chunk, comm_ns = _cost(1e6, overlap=False)
    assert chunk.tp_comm_forward_ns == comm_ns
    hidden, _ = _cost(1e6, overlap=True)
    assert hidden.forward_ns < chunk.forward_ns


def test_overlap_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match=r"^training.tp_comm_overlap requires parallel.sequence_parallel "
                                          r"\(got false\): TransformerEngine overlaps"):
        _cost(1e6, overlap=True, plan=ParallelPlan(tensor_parallel=8))
    with pytest.raises(ConfigError, match="^training.tp_comm_overlap must be true or false, got 'yes'$"):
        TrainingSpec(global_batch_size=1, tp_comm_overlap="yes")

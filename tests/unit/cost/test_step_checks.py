"""The per-step host work of Megatron-LM's NaN checks, per-token loss and manual GC: exact kernels,
host waits and collectives per flag (megatron-core 0.16's check_grads, validate_result,
finalize_model_grads), and their time with waits against the same kernels without."""

from types import SimpleNamespace

import pytest

from vtrain_plugin.core.graph import BlockKind, CollectiveKind, ParallelGroup
from vtrain_plugin.cost import step_checks as sc
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import GradReduce, SoftwareStack, TrainingSpec

TE = SoftwareStack.MEGATRON_CORE_TE

FP32 = 4
MILLION = 1_000_000
# a chunk: 3 layers of 20M parameters (5M of them experts') and a head of 10M
STAGE = SimpleNamespace(blocks=(
    SimpleNamespace(kind=BlockKind.LAYER, num_parameters=20 * MILLION, num_expert_parameters=5 * MILLION, count=3),
    SimpleNamespace(kind=BlockKind.HEAD, num_parameters=10 * MILLION, num_expert_parameters=0, count=1)))


def _ops(pieces):
    return [[n.op.split(".")[1] for n in p.kernels] for p in pieces]


def _waits(pieces):
    return sum(p.wait for p in pieces)


def test_loss_pieces_per_flag():
    on = sc.loss_pieces(TrainingSpec(global_batch_size=8), TE)
    assert _ops(on) == [["clamp", "div_", "div_", "isnan", "_to_copy"], ["isinf", "_to_copy"]] and _waits(on) == 2
    off = sc.loss_pieces(TrainingSpec(global_batch_size=8, nan_checks=False), TE)
    assert _ops(off) == [["clamp", "div_", "div_"]] and _waits(off) == 0
    token = sc.loss_pieces(TrainingSpec(global_batch_size=8, per_token_loss=True), TE)
    assert _ops(token) == [["isnan", "_to_copy"], ["isinf", "_to_copy"]] and _waits(token) == 2
    assert sc.loss_pieces(TrainingSpec(global_batch_size=8, per_token_loss=True, nan_checks=False), TE) == ()
    assert sc.loss_pieces(TrainingSpec(global_batch_size=8), SoftwareStack.MEGATRON_DEEPSPEED_2023) == ()


def test_gradient_buffers_and_buckets():
    dense, expert = sc.gradient_buffers(STAGE, FP32)
    assert (dense, expert) == (55 * MILLION * FP32, 15 * MILLION * FP32)
    after = TrainingSpec(global_batch_size=8, grad_reduce=GradReduce.AFTER_BACKWARD)
    assert sc.buckets((dense, expert), after, 8, FP32) == (dense, expert)  # one bucket per buffer
    overlap = TrainingSpec(global_batch_size=8, grad_reduce=GradReduce.OVERLAP)
    limit = 40 * MILLION * FP32  # megatron-core's default bucket: max(4e7, 1e6 x DP) parameters
    assert sc.buckets((dense, expert), overlap, 8, FP32) == (limit, dense - limit, expert)


def test_step_pieces_per_flag():
    training = TrainingSpec(global_batch_size=8, grad_reduce=GradReduce.OVERLAP)
    plan = ParallelPlan(pipeline_parallel=2, data_parallel=4, micro_batch_size=1)
    checks = sc.step_pieces(STAGE, training, plan, FP32, TE)
    assert len(checks) == 6 and _waits(checks) == 6  # 3 buckets, isnan and isinf each
    norms = [n for p in checks for n in p.kernels if n.op == "aten.linalg_vector_norm.default"]
    assert sum(n.nbytes for n in norms) == 70 * MILLION * FP32 and len(norms) == 3
    token = sc.step_pieces(STAGE, TrainingSpec(global_batch_size=8, nan_checks=False, per_token_loss=True), plan, FP32, TE)
    assert [c for p in token for c in p.collectives] == [(CollectiveKind.BROADCAST, 4, ParallelGroup.PP),
                                                         (CollectiveKind.ALL_REDUCE, 4, ParallelGroup.DP)]
    assert _ops(token) == [["gt", "_to_copy"], ["mul_", "mul_"]] and _waits(token) == 1
    assert sum(n.nbytes for n in token[1].kernels) == 2 * 70 * MILLION * FP32  # read and write every gradient
    alone = sc.step_pieces(STAGE, TrainingSpec(global_batch_size=8, nan_checks=False, per_token_loss=True),
                           ParallelPlan(micro_batch_size=1), FP32, TE)
    assert [c for p in alone for c in p.collectives] == []  # PP 1, DP 1: nothing to share
    assert sc.step_pieces(STAGE, TrainingSpec(global_batch_size=8, nan_checks=False), plan, FP32, TE) == ()


def test_waits_expose_host_time():
    timer = KernelTimer(get_device("h100-sxm"), calibration_for("h100-sxm", "megatron_core_te").constants)
    comm = CommModel(cluster=get_cluster_preset("dgx-h100"), tensor_parallel=1, pipeline_parallel=1, data_parallel=8)
    pieces = sc.loss_pieces(TrainingSpec(global_batch_size=8), TE)
    waited = sc.pieces_ns(pieces, timer, comm, 0)
    flowing = sc.pieces_ns([sc.Piece(tuple(n for p in pieces for n in p.kernels), wait=False)], timer, comm, 0)
    host = sum(timer.model.host_ns(n) for p in pieces for n in p.kernels)
    device_ns = sum(timer.model.duration_ns(n) for p in pieces for n in p.kernels)
    assert flowing < waited <= host + device_ns + 1e-6
    assert sc.pieces_ns((), timer, comm, 0) == 0.0


def test_manual_gc():
    assert sc.gc_host_factor(TrainingSpec(global_batch_size=8)) == 1.0
    assert sc.gc_host_factor(TrainingSpec(global_batch_size=8, manual_gc=True)) == pytest.approx(1 - sc.GC_HOST_SHARE)
    assert sc.gc_step_ns(TrainingSpec(global_batch_size=8, manual_gc=True), 1.2) == 0.0  # interval 0: never
    assert sc.gc_step_ns(TrainingSpec(global_batch_size=8, manual_gc=True, manual_gc_interval=100), 1.5) == \
        pytest.approx(1.5 * sc.FULL_COLLECT_NS / 100)
    assert sc.gc_step_ns(TrainingSpec(global_batch_size=8, manual_gc_interval=100), 1.0) == 0.0  # needs --manual-gc

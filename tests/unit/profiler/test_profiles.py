"""Profiles in estimates: device matching, reading the database, measured comm tables, comparisons."""

import time
from dataclasses import replace

import pytest
import torch

from profiler.db import ProfileDB
from profiler.device_timing import TimingPolicy
from profiler.fingerprint import DeviceFingerprint, DeviceKind, current_fingerprint
from profiler.lookup import measured_comm_tables, measured_durations
from profiler.replay import replay_kernel
from vtrain_plugin.runs import with_gpu
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError, ProfileError
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import KernelKey
from vtrain_plugin.core.graph import ParallelGroup as G
from vtrain_plugin.cost import CommModel
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import gpu_name_matches
from vtrain_plugin.hardware.nccl import NcclTable
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec
from vtrain_plugin.measured.iterations import IterationRecorder, compare_iterations
from vtrain_plugin.measured.one_device import single_device_run

H100 = DeviceFingerprint(kind=DeviceKind.CUDA, device_name="NVIDIA H100 80GB HBM3", sm_count_or_cores=132,
                         cpu_model="AMD EPYC 9654", torch_version="2.13.0", cuda_version="12.8")
A100_40 = replace(H100, device_name="NVIDIA A100-SXM4-40GB", sm_count_or_cores=108)
OTHER_CPU = DeviceFingerprint(kind=DeviceKind.CPU, device_name="Some Other CPU", sm_count_or_cores=2,
                              cpu_model="Some Other CPU", torch_version="2.13.0")

TINY = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=128,
                 dtype="fp32", name="tiny")


def run_on(gpu: str) -> RunConfig:
    run = RunConfig(model=TINY, parallel=ParallelPlan(micro_batch_size=2), training=TrainingSpec(global_batch_size=4),
                    cluster=get_cluster_preset("local-cpu"))
    return with_gpu(run, gpu)


def durations_for(run: RunConfig, db_path) -> dict[KernelKey, float]:
    """Measured durations of ``run``'s kernels on its cluster's device."""
    keys = trace(run.model, run.parallel).unique_kernels()
    return measured_durations(keys, run.cluster.gpu, db_path=db_path)


@pytest.mark.parametrize("preset, name, expected", [
    ("h100-sxm", "NVIDIA H100 80GB HBM3", True),
    ("h100-sxm", "NVIDIA H100 PCIe", False),
    ("h100-sxm", "NVIDIA H200", False),
    ("h200-sxm", "NVIDIA H200", True),
    ("a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", True),
    ("a100-sxm4-80gb", "NVIDIA A100-SXM4-40GB", False),
    ("a100-sxm4-40gb", "NVIDIA A100-SXM4-40GB", True),
    ("a100-sxm4-80gb", "NVIDIA A100 80GB PCIe", False),
    ("a100-sxm4-80gb", "NVIDIA A10", False),
])
def test_gpu_name_matching_rule(preset, name, expected):
    assert gpu_name_matches(preset, name) is expected


def test_missing_database_reads_as_empty_and_is_not_created(tmp_path):
    path = tmp_path / "none.sqlite"
    assert durations_for(run_on("cpu"), db_path=path) == {}
    assert measured_comm_tables(run_on("h100").cluster, db_path=path) == {}
    assert not path.exists()


def test_corrupt_database_is_a_profile_error(tmp_path):
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"not a database at all, just text" * 10)
    with pytest.raises(ProfileError, match="not a SQLite file"):
        durations_for(run_on("cpu"), db_path=path)


def test_durations_come_from_the_target_devices_profile_only(tmp_path):
    keys = list(trace(TINY, ParallelPlan(micro_batch_size=2)).unique_kernels())
    path = tmp_path / "p.sqlite"
    with ProfileDB.open(path) as db:
        for i, key in enumerate(keys):
            db.put_kernel(H100, key, 1000.0 + i, 5, 1.0)
        db.put_kernel(A100_40, keys[0], 7.0, 5, 1.0)
        db.put_kernel(OTHER_CPU, keys[0], 9.0, 5, 1.0)
        db.put_kernel(current_fingerprint("cpu"), keys[1], 3.0, 5, 1.0)
    h100 = durations_for(run_on("h100"), db_path=path)
    assert len(h100) == len(keys) and h100[keys[0]] == 1000.0
    assert durations_for(run_on("a100-sxm4-40gb"), db_path=path) == {keys[0]: 7.0}
    assert durations_for(run_on("a100"), db_path=path) == {}  # the 80 GB preset: no 80 GB profile
    assert durations_for(run_on("cpu"), db_path=path) == {keys[1]: 3.0}  # this CPU, not the other


def test_comm_tables_feed_the_comm_model(tmp_path):
    path = tmp_path / "p.sqlite"
    with ProfileDB.open(path) as db:
        for nbytes in (1024, 2048, 4096):
            db.put_comm(H100, K.ALL_REDUCE, 4, "nccl", nbytes, nbytes * 10.0)
            db.put_comm(H100, K.SEND, 2, "nccl", nbytes, nbytes * 1.0)
            db.put_comm(H100, K.ALL_REDUCE, 4, "gloo", nbytes, 1.0)  # another backend: ignored
    run = run_on("h100")
    tables = measured_comm_tables(run.cluster, db_path=path)
    assert set(tables) == {(K.ALL_REDUCE, 4), (K.SEND, 2), (K.RECV, 2)}
    assert tables[(K.ALL_REDUCE, 4)].times_ns == (10240.0, 20480.0, 40960.0)
    model = CommModel.for_plan(run.cluster, ParallelPlan(tensor_parallel=4, data_parallel=2),
                               measured_comm=tables)
    assert model.time_ns(K.ALL_REDUCE, 3072, G.TP) == pytest.approx(30720.0)  # interpolated
    assert model.time_ns(K.ALL_REDUCE, 8192, G.TP) == pytest.approx(81920.0)  # bandwidth above the table
    assert model.send_recv_ns(2048, across_nodes=False) == pytest.approx(2048.0)
    plain = CommModel.for_plan(run.cluster, ParallelPlan(tensor_parallel=4, data_parallel=2))
    assert model.time_ns(K.ALL_REDUCE, 4096, G.DP) == plain.time_ns(K.ALL_REDUCE, 4096, G.DP)  # no 2-rank table
    assert model.send_recv_ns(2048, across_nodes=True) == plain.send_recv_ns(2048, across_nodes=True)


def test_measured_comm_table_takes_precedence_over_cluster_tables():
    cluster = get_cluster_preset("dgx-a100")  # names the a100_sxm all-reduce tables
    table = NcclTable(num_gpus=8, sizes_nbytes=(1 << 20,), times_ns=(123.0,))
    model = CommModel.for_plan(cluster, ParallelPlan(tensor_parallel=8), measured_comm={(K.ALL_REDUCE, 8): table})
    assert model.time_ns(K.ALL_REDUCE, 1 << 20, G.TP) == 123.0


def test_replay_passes_numbers_given_for_tensor_arguments():
    key = KernelKey(op="aten.mul_.Tensor", input_shapes=((64,),), dtypes=("float32",), args=(("other", 0.95),))
    result = replay_kernel(key, "cpu", policy=TimingPolicy(warmup=1, min_repetitions=3, max_repetitions=3))
    assert result.median_ns > 0 and result.repetitions == 3


def test_single_device_run_overrides_and_says_so():
    run = RunConfig(model=replace(TINY, num_layers=4),
                    parallel=ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2,
                                          micro_batch_size=1),
                    training=TrainingSpec(global_batch_size=8), cluster=get_cluster_preset("dgx-a100"))
    single, overridden = single_device_run(run, "cpu")
    assert single.parallel.world_size == 1 and single.cluster.gpu == "cpu" and single.cluster.gpus_per_node == 1
    assert overridden == ("tensor_parallel: 2 -> 1", "pipeline_parallel: 2 -> 1", "data_parallel: 2 -> 1")
    assert single.num_microbatches == 8


def test_single_device_run_of_a_bf16_model_accumulates_bf16_gradients():
    """The real step accumulates a bf16 model's gradients in bf16 (each weight's .grad): the run
    says so, as Megatron's --grad-reduce-in-bf16, whose gradient buffer holds the same bytes."""
    run = RunConfig(model=replace(TINY, dtype="bf16"), parallel=ParallelPlan(micro_batch_size=1),
                    training=TrainingSpec(global_batch_size=2), cluster=get_cluster_preset("dgx-a100"))
    single, overridden = single_device_run(run, "cpu")
    assert single.training.grad_reduce_in_bf16 and single.training.grad_dtype(single.model.dtype).value == "bf16"
    assert overridden == ("grad_reduce_in_bf16: False -> True (what the real step runs)",)
    assert not single_device_run(replace(run, model=TINY), "cpu")[0].training.grad_reduce_in_bf16  # fp32


def test_compare_and_iteration_recorder():
    c = compare_iterations(110.0, [90.0, 100.0, 130.0])
    assert c.measured_ms == 100.0 and c.error_pct == pytest.approx(10.0)
    recorder = IterationRecorder(warmup=1)
    recorder.record(500.0)
    for _ in range(2):
        with recorder:
            time.sleep(0.002)
    assert len(recorder.samples_ms) == 2 and all(ms >= 2.0 for ms in recorder.samples_ms)
    assert recorder.compare(recorder.samples_ms[0]).predicted_ms == recorder.samples_ms[0]
    with pytest.raises(ConfigError, match="at least one"):
        compare_iterations(1.0, [])
    with pytest.raises(ConfigError, match="positive"):
        recorder.record(0)
    with pytest.raises(ConfigError, match="none after the 3 warm-up"):
        IterationRecorder(warmup=3).compare(1.0)


def test_models_that_do_not_fit_are_refused():
    from megatron_adapters.real_model import check_fits

    huge = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, dtype="fp32")
    with pytest.raises(ConfigError, match=r"needs about [\d,.]+ GiB to train on one device, more than"):
        check_fits(huge, ParallelPlan(), torch.device("cpu"))


def test_refusal_check_counts_model_states_as_the_real_step_keeps_them():
    """bf16 weights and .grad, fp32 main weights and two Adam moments: 16 bytes a parameter (not
    Megatron's 18, whose bf16 runs reduce gradients in an fp32 buffer the one-device step does not have)."""
    from megatron_adapters.real_model import required_memory_bytes

    bf16 = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, dtype="bf16")
    fp32 = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, dtype="fp32")
    plan = ParallelPlan()
    # activations and logits scale with the dtype's bytes; the model states are 16 bytes a parameter in both
    bf16_rest = required_memory_bytes(bf16, plan) - 16 * bf16.num_parameters
    fp32_rest = required_memory_bytes(fp32, plan) - 16 * fp32.num_parameters
    assert bf16.num_parameters == fp32.num_parameters
    assert 2 * (bf16_rest - 3 * 4 * 128 * bf16.padded_vocab_size(1)) == fp32_rest - 3 * 4 * 128 * fp32.padded_vocab_size(1)

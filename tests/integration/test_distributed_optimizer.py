"""The distributed optimizer's data-parallel traffic equals Megatron-Core's, bucket by bucket.

The reference is megatron-core's own ``DistributedDataParallel`` with ``use_distributed_optimizer``
wrapped around the same model chunk on the fake process group (under FakeTensorMode, so its buffers
cost no memory): its buckets' ``grad_data`` (reduce-scattered) and ``param_data`` (all-gathered),
with Megatron-LM's settings (``grad_reduce_in_fp32`` for bf16, ``disable_bucketing`` for model
chunks after the first).
"""

import json

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import CollectiveKind, ParallelGroup
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.costing import cost
from vtrain_plugin.cost.comm.dp_buckets import ZeroRuntime, zero_layout
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.prepare import prepare, prepare_run
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

GPT = ModelSpec(num_layers=4, hidden_size=192, num_attention_heads=4, seq_length=64, vocab_size=1000, dtype="bf16")
PLAN = ParallelPlan(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2, data_parallel=3)
BUCKET_MB = 0.4  # 100,000 fp32 gradients: the first chunk of the first rank gets several buckets


def megatron_buckets(model: ModelSpec, plan: ParallelPlan, rank: int, chunk: int, *, overlap: bool,
                     bucket_size: int | None, grad_reduce_in_fp32: bool = True) -> list[tuple[int, str, str]]:
    """(elements, gradient dtype, parameter dtype) of each bucket megatron-core lays out."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
    from megatron_adapters.conventions import chunk_role
    from megatron_adapters.gpt import build_chunk

    layers = plan.chunk_layers(model)[rank][chunk]
    with quiet_megatron(), cpu_tracing_patches(), fake_world(plan, pipeline_rank=rank):
        reset_global_memory_buffer()
        with FakeTensorMode(allow_non_fake_inputs=True):
            gpt = build_chunk(model, plan, chunk_role(plan, rank, chunk), layers_per_chunk=layers)
            config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap,
                                                   use_distributed_optimizer=True, bucket_size=bucket_size)
            ddp = DistributedDataParallel(config=gpt.config, ddp_config=config, module=gpt, disable_bucketing=chunk > 0)
            buckets = [(b.grad_data.numel(), str(b.grad_data.dtype), str(b.param_data.dtype))
                       for buffer in ddp.buffers for b in buffer.buckets]
        reset_global_memory_buffer()
    return buckets


def linear_weight_numels(model: ModelSpec, plan: ParallelPlan, rank: int, chunk: int) -> int:
    """Elements of the weights of the layers' linears in megatron-core's chunk: the parameters
    TransformerEngine keeps in FP8 with fp8_param_gather (its Linear modules' weights)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_adapters.conventions import chunk_role
    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
    from megatron_adapters.gpt import build_chunk

    layers = plan.chunk_layers(model)[rank][chunk]
    with quiet_megatron(), cpu_tracing_patches(), fake_world(plan, pipeline_rank=rank):
        reset_global_memory_buffer()
        with FakeTensorMode(allow_non_fake_inputs=True):
            gpt = build_chunk(model, plan, chunk_role(plan, rank, chunk), layers_per_chunk=layers)
            numel = sum(p.numel() for name, p in gpt.named_parameters()
                        if ".layers." in name and name.rsplit(".", 2)[-2].startswith("linear_")
                        and name.endswith(".weight"))
        reset_global_memory_buffer()
    return numel


@pytest.fixture(scope="module")
def graph():
    return trace(GPT, PLAN, traced_layers=None)


@pytest.mark.parametrize("overlap", [False, True])
def test_buckets_equal_megatron_cores_element_for_element(graph, overlap):
    training = TrainingSpec(global_batch_size=12, schedule="interleaved_1f1b", distributed_optimizer=True,
                            grad_reduce="overlap" if overlap else "after_backward", bucket_size_mb=BUCKET_MB)
    for stage in graph.stages:
        runtime = runtime_collectives(stage, PLAN, dtype=GPT.dtype, tied_embeddings=GPT.tied, distributed_optimizer=True)
        numels = [n for block in stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
        zero = ZeroRuntime.of(runtime, pipeline_rank=stage.pipeline_rank, chunk=stage.chunk)
        ours = [(b.numel, "torch.float32", "torch.bfloat16") for b in zero_layout(numels, training, zero)]
        theirs = megatron_buckets(GPT, PLAN, stage.pipeline_rank, stage.chunk, overlap=overlap,
                                  bucket_size=int(BUCKET_MB * 1e6) // 4)
        assert ours == theirs, (stage.pipeline_rank, stage.chunk)
        if overlap and (stage.pipeline_rank, stage.chunk) == (0, 0):
            assert len(ours) > 2  # bucketed by size, and the shared word embedding alone
        # reduce-scatter of every gradient and all-gather of every parameter, plus Megatron's padding
        padding = sum(n for n, _, _ in theirs) - stage.num_parameters
        assert 0 <= padding < len(numels) * 64 + len(theirs) * 384


def test_costing_reduce_scatters_and_all_gathers_those_buckets(graph):
    training = TrainingSpec(global_batch_size=12, schedule="interleaved_1f1b", distributed_optimizer=True,
                            grad_reduce="overlap", bucket_size_mb=BUCKET_MB)
    cluster = get_cluster_preset("dgx-h100")
    comm = CommModel.for_plan(cluster, PLAN)
    device = get_device(cluster.gpu)
    stack = training.stack_for(GPT, device.architecture)
    constants = calibration_for(device.name, stack).constants
    prepared = prepare(graph, stack, distributed_optimizer=True)
    work = cost(prepared, timer=KernelTimer(device, constants), comm=comm, training=training, num_microbatches=4).work
    for stage in prepared.stages:
        rank, chunk = stage.stage.pipeline_rank, stage.stage.chunk
        numels = [n for block in stage.stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
        buckets = zero_layout(numels, training, ZeroRuntime.of(stage.runtime, pipeline_rank=rank, chunk=chunk))
        reduce = [comm.time_ns(CollectiveKind.REDUCE_SCATTER, b.numel * 4, ParallelGroup.DP, pipeline_rank=rank)
                  for b in buckets]
        gather = [comm.time_ns(CollectiveKind.ALL_GATHER, b.numel * 2, ParallelGroup.DP, pipeline_rank=rank)
                  for b in buckets]
        chunk_work = work.chunk(rank, chunk)
        if chunk > 0:  # one bucket group: communicated together
            assert [b.comm_ns for b in chunk_work.dp_buckets] == [sum(reduce)]
            assert [g.comm_ns for g in chunk_work.param_gathers] == [sum(gather)]
        else:
            assert sorted(b.comm_ns for b in chunk_work.dp_buckets) == sorted(reduce)
            assert [g.comm_ns for g in chunk_work.param_gathers] == gather[::-1]  # forward order


def test_distributed_optimizer_with_one_data_parallel_rank_is_a_no_op():
    plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=2)
    graph = trace(GPT, plan)
    cluster = get_cluster_preset("dgx-h100")
    plain = TrainingSpec(global_batch_size=4)
    zero = TrainingSpec(global_batch_size=4, distributed_optimizer=True)
    from vtrain_plugin.estimate import estimate

    a, b = estimate(graph, cluster=cluster, training=plain), estimate(graph, cluster=cluster, training=zero)
    assert a.iteration_time_ms == b.iteration_time_ms
    assert a.memory_gib == b.memory_gib


def test_cli_estimate_of_a_plan_file_with_the_distributed_optimizer(tmp_path, run_cli):
    plan = {"model": {"family": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
                      "seq_length": 128, "vocab_size": 1024, "dtype": "bf16"},
            "parallel": {"tensor_parallel": 2, "data_parallel": 4},
            "training": {"global_batch_size": 8, "grad_reduce": "overlap"}, "cluster": {"preset": "dgx-h100"}}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(plan))
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({**plan, "training": {**plan["training"], "distributed_optimizer": True,
                                                     "overlap_param_gather": True}}))
    proc = run_cli("estimate", str(plain), str(zero), "--format", "jsonl", check=True)
    a, b = (json.loads(line) for line in proc.stdout.splitlines())
    assert (a["distributed_optimizer"], b["distributed_optimizer"]) == (False, True)
    (ma,), (mb,) = a["memory_gib_per_stage"], b["memory_gib_per_stage"]
    assert mb["optimizer"] == pytest.approx(ma["optimizer"] / 4, rel=1e-12)
    assert (mb["weights"], mb["gradients"]) == (ma["weights"], ma["gradients"])
    table = run_cli("estimate", str(zero), check=True).stdout
    assert "distributed optimizer on" in table.splitlines()[4]


def test_trace_report_lists_reduce_scatters_and_all_gathers_of_every_parameter(graph):
    from vtrain_plugin.cli.render import trace_json

    for stage, report in zip(graph.stages, trace_json(graph, SoftwareStack.MEGATRON_CORE_TE,
                                                                   distributed_optimizer=True)["stages"]):
        dp = [c for c in report["collectives"] if c["group"] == "dp"]
        assert {c["kind"] for c in dp} == {"reduce_scatter", "all_gather"}
        scattered = sum(c["nbytes"] * c["count"] for c in dp if c["kind"] == "reduce_scatter")
        gathered = sum(c["nbytes"] * c["count"] for c in dp if c["kind"] == "all_gather")
        assert (scattered, gathered) == (4 * stage.num_parameters, 2 * stage.num_parameters)  # fp32 grads, bf16


def test_grad_reduce_in_bf16_buckets_equal_megatron_cores_and_halve_the_reduce_scatters(graph):
    """--grad-reduce-in-bf16 (megatron-core DDP's grad_reduce_in_fp32=False): bf16 gradient buffers,
    the bucket size in elements from 2-byte gradients, and reduce-scatters of half the bytes."""
    training = TrainingSpec(global_batch_size=12, schedule="interleaved_1f1b", distributed_optimizer=True,
                            grad_reduce="overlap", bucket_size_mb=BUCKET_MB, grad_reduce_in_bf16=True)
    for stage in graph.stages:
        runtime = runtime_collectives(stage, PLAN, dtype=GPT.dtype, tied_embeddings=GPT.tied, distributed_optimizer=True,
                                      grads=training.grad_dtype(GPT.dtype))
        numels = [n for block in stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
        zero = ZeroRuntime.of(runtime, pipeline_rank=stage.pipeline_rank, chunk=stage.chunk)
        ours = [(b.numel, "torch.bfloat16", "torch.bfloat16") for b in zero_layout(numels, training, zero)]
        assert ours == megatron_buckets(GPT, PLAN, stage.pipeline_rank, stage.chunk, overlap=True,
                                        bucket_size=int(BUCKET_MB * 1e6) // 2, grad_reduce_in_fp32=False)
    prepared, work, comm = _costed_on_h100(graph, training)
    stage = prepared.stages[-1]  # a later chunk: its buckets reduce-scattered together
    rank = stage.stage.pipeline_rank
    numels = [n for block in stage.stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
    buckets = zero_layout(numels, training, ZeroRuntime.of(stage.runtime, pipeline_rank=rank, chunk=stage.stage.chunk))
    assert [b.comm_ns for b in work.chunk(rank, stage.stage.chunk).dp_buckets] == [
        sum(comm.time_ns(CollectiveKind.REDUCE_SCATTER, b.numel * 2, ParallelGroup.DP, pipeline_rank=rank)
            for b in buckets)]


def test_fp8_param_gather_all_gathers_the_layers_linear_weights_in_one_byte(graph):
    """--fp8-param-gather: the distributed optimizer all-gathers TransformerEngine's FP8 weights (the
    layers' linears) in one byte each, every other parameter in the model dtype."""
    from vtrain_plugin.cli.render import trace_json

    fp8 = trace_json(graph, SoftwareStack.MEGATRON_CORE_TE, distributed_optimizer=True, fp8_param_gather=True)
    for stage, report in zip(graph.stages, fp8["stages"]):
        weights = linear_weight_numels(GPT, PLAN, stage.pipeline_rank, stage.chunk)
        assert weights > 0
        gathered = sum(c["nbytes"] * c["count"] for c in report["collectives"]
                       if c["group"] == "dp" and c["kind"] == "all_gather")
        assert gathered == 1 * weights + 2 * (stage.num_parameters - weights)
    training = TrainingSpec(global_batch_size=12, schedule="interleaved_1f1b", distributed_optimizer=True,
                            grad_reduce="overlap", overlap_param_gather=True, fp8="hybrid", fp8_param_gather=True)
    prepared, work, comm = _costed_on_h100(graph, training)
    (stage,) = [s for s in prepared.stages if (s.stage.pipeline_rank, s.stage.chunk) == (0, 1)]  # layers only: one
    # bucket (a later chunk), its padding in bf16
    rank, chunk = stage.stage.pipeline_rank, stage.stage.chunk
    numels = [n for block in stage.stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
    (bucket,) = zero_layout(numels, training, ZeroRuntime.of(stage.runtime, pipeline_rank=rank, chunk=chunk))
    weights = linear_weight_numels(GPT, PLAN, rank, chunk)
    assert [g.comm_ns for g in work.chunk(rank, chunk).param_gathers] == [
        comm.time_ns(CollectiveKind.ALL_GATHER, weights + 2 * (bucket.numel - weights), ParallelGroup.DP,
                     pipeline_rank=rank)]


def _costed_on_h100(graph, training):
    """``graph`` prepared for ``training`` on the TE stack and costed on a DGX H100 (4 micro-batches),
    with the communication model it was costed with."""
    cluster = get_cluster_preset("dgx-h100")
    device = get_device(cluster.gpu)
    constants = calibration_for(device.name, SoftwareStack.MEGATRON_CORE_TE).constants
    prepared = prepare_run(graph, SoftwareStack.MEGATRON_CORE_TE, training)
    comm = CommModel.for_plan(cluster, PLAN)
    work = cost(prepared, timer=KernelTimer(device, constants), comm=comm, training=training, num_microbatches=4).work
    return prepared, work, comm

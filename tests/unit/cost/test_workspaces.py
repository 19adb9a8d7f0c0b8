"""The GEMM workspaces of each pipeline rank, on small real megatron-core models traced on the fake
process group: PyTorch's cuBLAS workspace where a GEMM is PyTorch's, TransformerEngine's beside it,
four more with TE's grouped-GEMM experts; sized by the GPU's generation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vtrain_plugin import estimate
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.workspaces import workspace_nbytes
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

MIB = 1024 * 1024
GPT = ModelSpec(family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16")
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
LOCAL, TE = SoftwareStack.MEGATRON_CORE_LOCAL, SoftwareStack.MEGATRON_CORE_TE
AMPERE, HOPPER = GpuArchitecture.AMPERE, GpuArchitecture.HOPPER
TORCH_AMPERE, TORCH_HOPPER = 8 * MIB + 128 * 1024, 32 * MIB  # ":4096:2:16:8", ":4096:8"
TE_AMPERE, TE_HOPPER = 4 * MIB, 32 * MIB + 1024  # get_cublas_workspace_size_bytes


@pytest.fixture(scope="module")
def gpt():
    from vtrain_plugin.capture.tracer import trace

    return trace(GPT, ParallelPlan(pipeline_parallel=2, micro_batch_size=2))


@pytest.fixture(scope="module")
def moe():
    from vtrain_plugin.capture.tracer import trace

    return trace(MOE, ParallelPlan(pipeline_parallel=2, expert_parallel=2, data_parallel=2, micro_batch_size=2))


def test_the_local_spec_holds_pytorchs_workspace_on_every_rank(gpt):
    assert workspace_nbytes(gpt, LOCAL, AMPERE) == (TORCH_AMPERE,) * 2
    assert workspace_nbytes(gpt, LOCAL, HOPPER) == (TORCH_HOPPER,) * 2
    assert workspace_nbytes(gpt, LOCAL, GpuArchitecture.CPU) == workspace_nbytes(gpt, LOCAL, None) == (0, 0)


def test_transformer_engine_adds_its_own_and_pytorchs_gemms_are_the_output_layer_and_the_router(gpt, moe):
    assert workspace_nbytes(gpt, TE, AMPERE) == (TE_AMPERE, TE_AMPERE + TORCH_AMPERE)  # rank 0: TE's GEMMs only
    assert workspace_nbytes(gpt, TE, HOPPER) == (TE_HOPPER, TE_HOPPER + TORCH_HOPPER)
    assert workspace_nbytes(moe, TE, HOPPER) == (TE_HOPPER + TORCH_HOPPER,) * 2  # every rank routes


def test_grouped_gemm_experts_add_a_workspace_per_stream(moe):
    grouped = replace(moe, model=replace(MOE, moe_grouped_gemm=True))
    assert workspace_nbytes(grouped, TE, HOPPER) == (5 * TE_HOPPER + TORCH_HOPPER,) * 2
    # once per GPU, however many of its chunks run experts
    chunks = replace(grouped, parallel=replace(grouped.parallel, virtual_pipeline=2),
                     stages=tuple(replace(s, chunk=c) for s in grouped.stages for c in (0, 1)))
    assert workspace_nbytes(chunks, TE, HOPPER) == (5 * TE_HOPPER + TORCH_HOPPER,) * 2
    assert workspace_nbytes(chunks, TE, HOPPER, tp_comm_overlap=True) == (7 * TE_HOPPER + TORCH_HOPPER,) * 2
    assert workspace_nbytes(grouped, TE, AMPERE) == (5 * TE_AMPERE + TORCH_AMPERE,) * 2
    assert workspace_nbytes(grouped, LOCAL, HOPPER) == (TORCH_HOPPER,) * 2  # no TE: no grouped-GEMM streams


def test_tp_comm_overlap_repeats_transformer_engines_workspace_for_its_streams(gpt, moe):
    # initialize_ub: get_workspace().repeat(_NUM_MAX_UB_STREAMS), 3 streams, in place of the one
    assert workspace_nbytes(gpt, TE, HOPPER, tp_comm_overlap=True) == (3 * TE_HOPPER, 3 * TE_HOPPER + TORCH_HOPPER)
    assert workspace_nbytes(gpt, TE, AMPERE, tp_comm_overlap=True) == (3 * TE_AMPERE, 3 * TE_AMPERE + TORCH_AMPERE)
    grouped = replace(moe, model=replace(MOE, moe_grouped_gemm=True))
    assert workspace_nbytes(grouped, TE, HOPPER, tp_comm_overlap=True) == (7 * TE_HOPPER + TORCH_HOPPER,) * 2
    assert workspace_nbytes(gpt, LOCAL, HOPPER, tp_comm_overlap=True) == (TORCH_HOPPER,) * 2  # no TE, no ub


@pytest.mark.parametrize(("gpu", "nbytes"), [("a100", TE_AMPERE + TORCH_AMPERE), ("h100", TE_HOPPER + TORCH_HOPPER)])
def test_the_estimate_counts_them_in_peak_allocated(gpt, gpu, nbytes):
    est = estimate(gpt, cluster=cluster_for_gpu(gpu), training=TrainingSpec(global_batch_size=4,
                                                                            software_stack=TE), profile_db=False)
    last = est.memory_gib[-1]
    assert last.workspaces_gib * GIB == nbytes
    assert last.tensors_gib == pytest.approx(last.weights_gib + last.gradients_gib + last.optimizer_gib
                                             + last.activations_gib + nbytes / GIB)
    assert last.to_dict()["workspaces"] == nbytes / GIB

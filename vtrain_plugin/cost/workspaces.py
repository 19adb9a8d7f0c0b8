"""The GEMM libraries' workspaces each GPU allocates once and keeps: PyTorch's cuBLAS workspace, by
GPU generation and software stack, in bytes per pipeline rank.

It comes from PyTorch's caching allocator, so ``max allocated`` counts it: PyTorch keeps one cuBLAS
workspace per handle and stream (``CublasHandlePool.cpp``, ``getNewWorkspace``), sized by
``CUBLAS_WORKSPACE_CONFIG``, by default ``:4096:2:16:8`` (8 MiB + 128 KiB: the 8,519,680 bytes
``memory_allocated`` shows after a first matmul) before Hopper and ``:4096:8`` (32 MiB) on Hopper;
Megatron runs its GEMMs on the one compute stream, so one per GPU where any GEMM is PyTorch's: every
rank of the local spec, and with TransformerEngine the ranks of the output layer (megatron-core's
``ColumnParallelLinear``) or of an MoE router.

Why: on the small models of NVIDIA's functional tests it is 1-4% of the measured peak, and its size
is part of why H100 runs hold more than the same runs on A100. Not counted: a
``CUBLAS_WORKSPACE_CONFIG`` set by the user (deterministic runs set it, commonly to the Hopper
default), cuBLASLt's own workspace (PyTorch's shares the cuBLAS one), Blackwell taken as Hopper.
"""

from __future__ import annotations

from vtrain_plugin.core.graph import BlockKind, OpGraph, StageGraph
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.training import SoftwareStack

KIB = 1024
TORCH_CUBLAS_NBYTES = 4096 * KIB * 2 + 16 * KIB * 8  # ":4096:2:16:8", PyTorch's default before Hopper
TORCH_CUBLAS_HOPPER_NBYTES = 4096 * KIB * 8  # ":4096:8", its default on Hopper


def workspace_nbytes(graph: OpGraph, stack: SoftwareStack, architecture: GpuArchitecture | None) -> tuple[int, ...]:
    """Bytes of GEMM workspaces each pipeline rank of ``graph`` holds as ``stack`` runs it on a GPU of
    ``architecture`` (None or the CPU: none)."""
    if architecture is None or architecture is GpuArchitecture.CPU:
        return (0,) * graph.parallel.pipeline_parallel
    hopper = architecture is not GpuArchitecture.AMPERE
    torch_nbytes = TORCH_CUBLAS_HOPPER_NBYTES if hopper else TORCH_CUBLAS_NBYTES
    te = stack is SoftwareStack.MEGATRON_CORE_TE
    torch_gemm = [not te] * graph.parallel.pipeline_parallel
    for stage in graph.stages:
        if te and _runs_torch_gemm(stage):
            torch_gemm[stage.pipeline_rank] = True
    return tuple(torch_nbytes * uses_torch for uses_torch in torch_gemm)


def _runs_torch_gemm(stage: StageGraph) -> bool:
    """Whether a TransformerEngine stage runs a GEMM of PyTorch's: megatron-core's output layer
    (the head) or an MoE router (a stage with experts)."""
    return stage.num_expert_parameters > 0 or any(b.kind is BlockKind.HEAD for b in stage.blocks)

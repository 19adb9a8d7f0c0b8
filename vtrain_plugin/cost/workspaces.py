"""The GEMM libraries' workspaces each GPU allocates once and keeps: PyTorch's cuBLAS workspace and
TransformerEngine's, by GPU generation and software stack, in bytes per pipeline rank.

Both come from PyTorch's caching allocator, so ``max allocated`` counts them:

- PyTorch keeps one cuBLAS workspace per handle and stream (``CublasHandlePool.cpp``,
  ``getNewWorkspace``), sized by ``CUBLAS_WORKSPACE_CONFIG``, by default ``:4096:2:16:8`` (8 MiB +
  128 KiB: the 8,519,680 bytes ``memory_allocated`` shows after a first matmul) before Hopper and
  ``:4096:8`` (32 MiB) on Hopper; Megatron runs its GEMMs on the one compute stream, so one per GPU
  where any GEMM is PyTorch's: every rank of the local spec, and with TransformerEngine the ranks of
  the output layer (megatron-core's ``ColumnParallelLinear``) or of an MoE router;
- TransformerEngine keeps one cuBLAS workspace for its GEMMs (``module.base.get_workspace``,
  ``get_cublas_workspace_size_bytes``: 4 MiB before Hopper, 32 MiB + 1 KiB from Hopper on) and, once
  a grouped GEMM runs (``GroupedLinear``: megatron-core's ``TEGroupedMLP``, ``moe_grouped_gemm``),
  one more per multi-stream cuBLAS stream (``get_multi_stream_cublas_workspace``, 4 streams);
  with TP communication overlap (Megatron-LM's ``--tp-comm-overlap``, which calls TE's
  ``initialize_ub``) that one workspace is replaced by its copy repeated for each of the overlapped
  GEMMs' streams (``get_workspace().repeat(_NUM_MAX_UB_STREAMS)``, 3 streams). The userbuffers
  themselves are registered by TE's C++ code outside PyTorch's allocator.

Why: on the small models of NVIDIA's functional tests they are 1-7% of the measured peak, and their
size is why H100 runs hold more than the same runs on A100. Not counted: a ``CUBLAS_WORKSPACE_CONFIG``
set by the user (deterministic runs set it, commonly to the Hopper default), cuBLASLt's own workspace
(PyTorch's shares the cuBLAS one), Blackwell taken as Hopper.
"""

from __future__ import annotations

from vtrain_plugin.core.graph import BlockKind, OpGraph, StageGraph
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.training import SoftwareStack

KIB = 1024
MIB = 1024 * KIB
TORCH_CUBLAS_NBYTES = 4096 * KIB * 2 + 16 * KIB * 8  # ":4096:2:16:8", PyTorch's default before Hopper
TORCH_CUBLAS_HOPPER_NBYTES = 4096 * KIB * 8  # ":4096:8", its default on Hopper
TE_CUBLAS_NBYTES = 4 * MIB  # TransformerEngine's get_cublas_workspace_size_bytes before Hopper
TE_CUBLAS_HOPPER_NBYTES = 32 * MIB + KIB  # from Hopper on: 32 MiB and 1 KiB for alignment and scales
TE_CUBLAS_STREAMS = 4  # TransformerEngine's multi-stream cuBLAS streams (grouped GEMMs)
TE_UB_STREAMS = 3  # TransformerEngine's _NUM_MAX_UB_STREAMS: its workspace repeated by initialize_ub


def workspace_nbytes(graph: OpGraph, stack: SoftwareStack, architecture: GpuArchitecture | None, *,
                     tp_comm_overlap: bool = False) -> tuple[int, ...]:
    """Bytes of GEMM workspaces each pipeline rank of ``graph`` holds as ``stack`` runs it on a GPU of
    ``architecture`` (None or the CPU: none), with TP communication overlap or not."""
    ranks = graph.parallel.pipeline_parallel
    if architecture is None or architecture is GpuArchitecture.CPU:
        return (0,) * ranks
    hopper = architecture is not GpuArchitecture.AMPERE
    torch_nbytes = TORCH_CUBLAS_HOPPER_NBYTES if hopper else TORCH_CUBLAS_NBYTES
    te = stack is SoftwareStack.MEGATRON_CORE_TE
    te_nbytes = (TE_CUBLAS_HOPPER_NBYTES if hopper else TE_CUBLAS_NBYTES) if te else 0
    grouped = te and graph.model is not None and graph.model.moe_grouped_gemm
    torch_gemm = [not te] * ranks
    base = TE_UB_STREAMS if te and tp_comm_overlap else 1  # TE's own, repeated by initialize_ub with TP overlap
    te_workspaces = [base] * ranks
    for stage in graph.stages:
        if te and _runs_torch_gemm(stage):
            torch_gemm[stage.pipeline_rank] = True
        if grouped and stage.num_expert_parameters:
            te_workspaces[stage.pipeline_rank] = base + TE_CUBLAS_STREAMS
    return tuple(torch_nbytes * uses_torch + te_nbytes * count for uses_torch, count in zip(torch_gemm, te_workspaces))


def _runs_torch_gemm(stage: StageGraph) -> bool:
    """Whether a TransformerEngine stage runs a GEMM of PyTorch's: megatron-core's output layer
    (the head) or an MoE router (a stage with experts)."""
    return stage.num_expert_parameters > 0 or any(b.kind is BlockKind.HEAD for b in stage.blocks)

"""CPU stand-ins for megatron-core norms: apex's FusedLayerNorm under sequence parallelism, L2Norm eager.

megatron-core's local spec falls back to ``WrappedTorchNorm`` without apex, which refuses
sequence parallelism only because torch's norms do not mark their parameters for the extra
tensor-parallel gradient all-reduce. This builds the same torch LayerNorm/RMSNorm (same kernels)
and marks the parameters as apex's FusedLayerNorm does.
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Build ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


class EagerL2Norm(torch.nn.Module):
    """megatron-core's ``L2Norm`` (Llama 4's QK norm) with the same math, run eagerly.

    megatron-core compiles its ``_norm`` with ``torch.compile`` (``jit_fuser``), which does not run
    under the tracer's fake tensors; on a GPU the compiled norm is one fused kernel per direction,
    which the lowering makes of the eager ops traced here
    (:mod:`vtrain_plugin.cost.lowering.megatron_core_te`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

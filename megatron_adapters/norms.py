"""A CPU stand-in for apex's FusedLayerNorm that megatron-core accepts under sequence parallelism.

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

"""What a sample input says about the batch a module is traced for: it is one micro-batch, so its
first dimension is the micro-batch size, and when it is a 2-D integer tensor of token ids
(``[micro_batch, seq_length]``) its second is the tokens per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleShape:
    micro_batch_size: int
    seq_length: int | None  # None: the input is not token ids, the tokens per sample are unknown


def as_arguments(sample_input: Any) -> tuple[Any, ...]:
    """The module's positional arguments: a tuple or list is several, anything else one."""
    return tuple(sample_input) if isinstance(sample_input, (tuple, list)) else (sample_input,)


def sample_shape(sample_input: Any) -> SampleShape:
    """The shape of ``sample_input``'s first argument (a micro-batch of 1 when it is no tensor)."""
    arguments = as_arguments(sample_input)
    first = arguments[0] if arguments else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return SampleShape(micro_batch_size=1, seq_length=None)
    token_ids = first.dim() == 2 and not first.is_floating_point()
    return SampleShape(micro_batch_size=int(first.shape[0]), seq_length=int(first.shape[1]) if token_ids else None)

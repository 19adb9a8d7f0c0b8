"""The routing assumption: how many tokens a MoE router sends to each expert, and what a rank's
token dispatcher therefore sends, receives and computes.

Routing is data: under fake tensors the router's top-k runs, but which experts it picks is unknown.
Megatron reads the resulting counts on the host (device-to-host copies, as numpy arrays) to size
the all-to-all and to split tokens among local experts; vtrain supplies them from this assumption:

- every rank of the expert tensor x expert parallel group routes alike: of its ``tokens`` tokens,
  ``tokens * topk`` token-expert pairs, the same number to each expert from every rank;
- balanced (``skew`` 1): each expert gets ``tokens * topk / experts`` of them (the remainder of an
  uneven division one each to the first experts);
- ``skew`` s > 1: expert 0, the busiest, gets ``s`` times the balanced share, rounded half up (at
  most ``tokens``: a token picks an expert once), the others share the rest evenly;
- the traced rank is expert-parallel rank 0, which holds the busiest expert: the all-to-all that
  combines the experts' outputs waits for it, so it sets the layer's pace;
- with a capacity factor ``c`` (token dropping), an expert takes at most megatron-core's capacity,
  ``ceil(tokens * topk / experts * c)`` pairs from each rank, and drops the rest; padded to
  capacity, it takes exactly that many.

The flex dispatcher's volume under the same assumption is :mod:`megatron_adapters.flex_routing`'s.

Nothing here imports megatron-core; :mod:`megatron_adapters.moe` hands these counts to megatron's
token dispatchers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.errors import ConfigError


def expert_token_counts(tokens: int, topk: int, num_experts: int, skew: float = 1.0, *,
                        capacity_factor: float | None = None, pad_to_capacity: bool = False) -> tuple[int, ...]:
    """Token-expert pairs one rank routes to each expert, busiest (expert 0) first, kept under
    ``capacity_factor`` (padded to the capacity with ``pad_to_capacity``): see the module doc."""
    if not 1 <= topk <= num_experts:
        raise ConfigError(f"moe_router_topk ({topk}) must lie in [1, num_experts ({num_experts})]")
    total = tokens * topk
    busiest = min(tokens, math.floor(skew * total / num_experts + 0.5))
    if num_experts == 1:
        routed: tuple[int, ...] = (total,)
    else:
        share, extra = divmod(total - busiest, num_experts - 1)
        routed = (busiest, *(share + (1 if i < extra else 0) for i in range(num_experts - 1)))
    if capacity_factor is None:
        return routed
    capacity = expert_capacity(tokens, topk, num_experts, capacity_factor)
    return (capacity,) * num_experts if pad_to_capacity else tuple(min(n, capacity) for n in routed)


def expert_capacity(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """megatron-core's ``get_capacity``: the pairs an expert takes from one rank of ``tokens`` tokens."""
    return math.ceil(tokens * topk / num_experts * capacity_factor)


@dataclass(frozen=True, slots=True)
class DispatchCounts:
    """What megatron-core's all-to-all dispatcher holds on the host for expert-parallel rank 0 and
    expert tensor-parallel rank 0, every count a numpy array as after its device-to-host copy.

    ``per_expert``: token-expert pairs each source rank routes to each expert. The EP group has
    ``ep`` ranks of ``num_experts / ep`` local experts each; the expert TP x EP group ``etp * ep``
    source ranks, all routing alike.
    """

    per_expert: tuple[int, ...]
    ep: int
    etp: int

    @property
    def num_local_experts(self) -> int:
        return len(self.per_expert) // self.ep

    @property
    def _local(self) -> np.ndarray:
        return np.asarray(self.per_expert[:self.num_local_experts], dtype=np.int64)

    @property
    def input_splits(self) -> np.ndarray:
        """[ep] rows this rank sends to each EP rank: the pairs of that rank's experts."""
        return np.asarray(self.per_expert, dtype=np.int64).reshape(self.ep, self.num_local_experts).sum(axis=1)

    @property
    def output_splits(self) -> np.ndarray:
        """[ep] rows this rank receives from each EP rank: their pairs for its local experts."""
        return np.full(self.ep, self._local.sum(), dtype=np.int64)

    @property
    def output_splits_tp(self) -> np.ndarray:
        """[etp] rows gathered from each expert TP rank after the all-to-all."""
        return np.full(self.etp, self.ep * self._local.sum(), dtype=np.int64)

    @property
    def tokens_per_local_expert(self) -> np.ndarray:
        """[local experts] rows each local expert computes: its pairs from every source rank."""
        return self.etp * self.ep * self._local

    @property
    def global_tokens_per_local_expert(self) -> np.ndarray:
        """[etp * ep, local experts] rows from each source rank to each local expert."""
        return np.tile(self._local, (self.etp * self.ep, 1))

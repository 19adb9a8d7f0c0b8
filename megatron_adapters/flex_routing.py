"""The flex dispatcher's volume under the balanced routing assumption: how many ranks and nodes
receive one token.

DeepEP sends a token once to each rank (and, across nodes, once to each node) that holds one of its
experts, not once per expert as the all-to-all dispatcher does; its volume is therefore the expected
number of such ranks and nodes per token when the router's top-k experts are drawn uniformly
(:mod:`megatron_adapters.moe_routing`'s balanced assumption). Imports nothing of vtrain or megatron:
the tracer's stand-in and the cost model read it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class FlexDispatch:
    """What the flex dispatcher's time depends on beside the message: the routing (experts, top-k,
    group-limited routing) and the expert TP x EP group (EP ranks, each expert TP ranks wide)."""

    num_experts: int
    topk: int
    expert_parallel: int
    expert_tensor_parallel: int
    num_groups: int | None = None  # group-limited routing: experts in this many groups...
    group_topk: int | None = None  # ... of which a token picks its experts from this many

    def ranks_hit(self) -> float:
        """Expected ranks of the group that receive one token: every expert-TP rank of each EP rank
        holding one of its experts (megatron-core expands the routing map over expert TP)."""
        return self.expert_tensor_parallel * self.units_hit(self.expert_parallel)

    def units_hit(self, units: int) -> float:
        return expected_units_hit(units, self.num_experts, self.topk, self.num_groups, self.group_topk)


def expected_units_hit(units: int, experts: int, topk: int, num_groups: int | None = None,
                       group_topk: int | None = None) -> float:
    """Expected number of ``units`` (EP ranks, or nodes; each holding ``experts / units`` consecutive
    experts) that a token's ``topk`` distinct experts fall in, the experts drawn uniformly (the
    balanced routing assumption); with group-limited routing, uniformly among those of
    ``group_topk`` of ``num_groups`` groups drawn uniformly. Units that hold whole groups, or lie
    inside one, are counted exactly; other splits fall back to the unlimited draw."""
    if units <= 1:
        return float(units)
    per_unit = experts / units
    if num_groups is None or group_topk is None:
        return units * (1.0 - comb(experts - int(per_unit), topk) / comb(experts, topk))
    per_group = experts // num_groups
    pool = group_topk * per_group  # experts a token may pick from
    if num_groups % units == 0:  # a unit holds whole groups: j of its groups chosen (hypergeometric)
        held = num_groups // units
        missed = sum(comb(held, j) * comb(num_groups - held, group_topk - j) / comb(num_groups, group_topk)
                     * comb(pool - j * per_group, topk) / comb(pool, topk)
                     for j in range(0, min(held, group_topk) + 1))
        return units * (1.0 - missed)
    if units % num_groups == 0:  # a unit inside a group: its group chosen, then none of its experts
        chosen = group_topk / num_groups
        missed = (1.0 - chosen) + chosen * comb(pool - int(per_unit), topk) / comb(pool, topk)
        return units * (1.0 - missed)
    return expected_units_hit(units, experts, topk)


def flex_dispatch(model: Any, plan: Any) -> FlexDispatch | None:
    """The flex dispatcher's routing of ``model`` (a ModelSpec) under ``plan`` (a ParallelPlan), or
    None when the plan uses another dispatcher."""
    if not model.is_moe or plan.moe_token_dispatcher.value != "flex":
        return None
    return FlexDispatch(num_experts=model.num_experts, topk=model.router_topk, expert_parallel=plan.expert_parallel,
                        expert_tensor_parallel=plan.expert_tp, num_groups=model.moe_router_num_groups,
                        group_topk=model.moe_router_group_topk)

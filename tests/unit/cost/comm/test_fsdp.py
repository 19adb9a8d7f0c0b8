"""FSDP's per-unit collectives against compute, worked by hand; prefetch and working set per setting."""

import pytest

from vtrain_plugin.cost.comm.fsdp import (FsdpUnit, exposed_ns, exposed_per_microbatch, prefetch_units, state_shards,
                                          working_set_units)
from vtrain_plugin.specs.fsdp import FsdpSettings

MEGATRON = FsdpSettings()
DOUBLE_BUFFER = FsdpSettings(double_buffer=True)
TORCH = FsdpSettings(implementation="torch")


def test_gathers_shorter_than_compute_expose_only_the_first():
    assert exposed_ns([10.0] * 3, [4.0] * 3, [0.0] * 3, prefetch=1) == 4.0


def test_gathers_longer_than_compute_set_the_pace():
    # AG0 0-15, AG1 15-30 (prefetched at 0); unit 0 computes 15-25 and issues AG2 at 25: 30-45;
    # unit 1 computes 30-40, unit 2 45-55: 55 - 30 of compute
    assert exposed_ns([10.0] * 3, [15.0] * 3, [0.0] * 3, prefetch=1) == 25.0


def test_reduce_scatters_queue_behind_the_gathers_and_the_last_one_is_exposed():
    # AG0 0-4, AG1 4-8; unit 0 computes 4-14, RS0 14-17; unit 1 issues AG2 at 14, after RS0: 17-21;
    # unit 1 computes 14-24, RS1 24-27; unit 2 computes 24-34 (AG2 ready at 21), RS2 34-37
    assert exposed_ns([10.0] * 3, [4.0] * 3, [3.0] * 3, prefetch=1) == 7.0


def test_deeper_prefetch_hides_a_large_gather():
    compute, gathers = [10.0] * 4, [1.0, 1.0, 18.0, 1.0]
    # one ahead: AG2 issued when unit 1 starts (11), done at 29; unit 2 computes 29-39, unit 3 39-49
    assert exposed_ns(compute, gathers, [0.0] * 4, prefetch=1) == 9.0
    # three ahead: all issued at 0, AG2 done at 20 while unit 1 computes 11-21: only AG0 exposed
    assert exposed_ns(compute, gathers, [0.0] * 4, prefetch=3) == 1.0


def test_per_strategy_collectives():
    units = [FsdpUnit(forward_ns=10.0, backward_ns=20.0, gather_ns=4.0, reduce_ns=3.0)] * 3
    assert exposed_per_microbatch(units, MEGATRON, 1) == (4.0, 4.0 + 3.0)  # gather in forward, gather + RS in backward
    assert exposed_per_microbatch(units, FsdpSettings(sharding_strategy="optim_grads"), 1) == (0.0, 3.0)
    assert exposed_per_microbatch(units, FsdpSettings(sharding_strategy="optim"), 1) == (0.0, 0.0)
    no_reshard = FsdpSettings(implementation="torch", reshard_after_forward=False)
    assert exposed_per_microbatch(units, no_reshard, 1) == (4.0, 3.0)  # backward keeps the forward's gathers


@pytest.mark.parametrize("settings, numels, prefetch", [
    (DOUBLE_BUFFER, [218_112_000] * 32, 1),  # two fixed buffers: one unit ahead
    (TORCH, [218_112_000] * 32, 1),
    (MEGATRON, [218_112_000] * 32, 3),  # 5e8 elements ahead: ceil(5e8 / 2.18e8)
    (FsdpSettings(communication_unit_elements=800_000_000), [856_000_000] * 80, 1),
    (MEGATRON, [1000] * 3, 2),  # never more than the other units
])
def test_prefetch_units_follow_megatron_fsdp(settings, numels, prefetch):
    assert prefetch_units(settings, numels) == prefetch


def test_working_set_per_setting():
    layers = [218_112_000] * 32
    assert working_set_units(DOUBLE_BUFFER, layers) == (2, 2)
    assert working_set_units(MEGATRON, layers) == (4, 1 + 4)  # 1 + 3 prefetched; RS queue of 1e9 elements
    assert working_set_units(FsdpSettings(sharding_strategy="optim_grads"), layers) == (0, 5)
    assert working_set_units(FsdpSettings(sharding_strategy="optim"), layers) == (0, 0)
    assert working_set_units(FsdpSettings(implementation="torch", reshard_after_forward=False), layers) == (32, 2)


def test_state_shards_per_strategy():
    shards = [state_shards(FsdpSettings(sharding_strategy=name), 8)
              for name in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    assert [(s.weights, s.gradients, s.optimizer) for s in shards] == [(1, 1, 1), (1, 1, 8), (1, 8, 8), (8, 8, 8)]

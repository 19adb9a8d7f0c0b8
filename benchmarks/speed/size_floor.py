"""How tight the best-first floor is on ``vtrain size``'s smallest shape, counted without tracing.

    .venv/bin/python -m benchmarks.speed.size_floor [BEST_DAYS]

gpt-h3072-l24 (the first shape of ``size --gpus 1:3360 --gpu A100 --days 30``), its Chinchilla
tokens and 2,048 sequences per iteration, the default SearchSpace pruned by memory as a search
prunes: the floors' CPU time, the floor of the best plan (TP 3, PP 2, VP 4, DP 512, micro-batch 1,
no recompute, overlapped gradient reduction, distributed optimizer: 0.0494 expected days, the
argument) against its days, and the plans and trace shapes whose floor is at most the best (the
plans a best-first search must cost, the shapes it must trace), and at most 0.03 and 0.02 days;
then the best-first rounds (plans, floors, new trace shapes), the best found by round 1 as in the
cold run, as they are and with each round also costing the untaken plans of shapes already traced
whose floor is at most the best so far.
Why: a plan's trace shape is traced once any of its plans has a floor under the best found, so
the floor's tightness sets the traces of ``size``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from vtrain_plugin.core.units import GIB
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.capture.chunk import plan_shape_key
from vtrain_plugin.planning.bounded import FIRST_ROUND_PLANS, plan_floors
from vtrain_plugin.planning.evaluate import make_batches
from vtrain_plugin.planning.model_family import chinchilla_tokens, family_shapes
from vtrain_plugin.planning.search import prune_by_memory
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.training import TrainingSpec

BEST_DAYS = 0.0494  # the best plan's expected days (2026-11-29_size_cold.txt, section 5)
BEST_PLAN = dict(tensor_parallel=3, pipeline_parallel=2, virtual_pipeline=4, data_parallel=512,
                 micro_batch_size=1, sequence_parallel=False, recompute="none")


def main(best_days: float = BEST_DAYS) -> None:
    cluster = get_cluster_preset("dgx-a100")
    model = family_shapes("gpt", min_params=1e9, max_params=2e12)[0]
    batch = 2**22 // model.seq_length
    training = TrainingSpec(global_batch_size=batch, total_tokens=chinchilla_tokens(model.num_parameters, 20))
    plans = enumerate_plans(model, SearchSpace(), global_batch_size=batch, budget=GpuBudget.parse("1:3360"),
                            training=training, gpus_per_node=cluster.gpus_per_node).candidates
    candidates, _ = prune_by_memory(model, plans, get_device(cluster.gpu).memory_bytes / GIB)
    start = time.process_time()
    floors = plan_floors(model, candidates, cluster, "expected_train_days")
    print(f"{model.name}: {len(candidates):,} plans after memory pruning; floors in "
          f"{time.process_time() - start:.1f} CPU-s")
    best = [i for i, c in enumerate(candidates)
            if all(str(getattr(c.parallel, k).value if k == "recompute" else getattr(c.parallel, k)) == str(v)
                   for k, v in BEST_PLAN.items())
            and c.training.grad_reduce.value == "overlap" and c.training.distributed_optimizer]
    print(f"lowest floor {floors.min():.4f} days ({floors.min() / best_days:.3f} of the best, {best_days} days); "
          f"the best plan's floor {floors[best[0]]:.4f} ({floors[best[0]] / best_days:.3f})")
    for cutoff in (best_days, 0.03, 0.02):
        chosen = [candidates[i] for i in np.flatnonzero(floors <= cutoff)]
        print(f"floor <= {cutoff:.4f} days: {len(chosen):,} plans in {len(make_batches(model, cluster, chosen))} "
              f"trace shapes")
    keys: dict[tuple, int] = {}
    shapes = np.array([keys.setdefault(plan_shape_key(c.parallel), len(keys)) for c in candidates])
    for same_shapes in (False, True):
        print("rounds" + (", with the plans of traced shapes:" if same_shapes else ":"))
        for plans, low, high, new, traced in rounds(floors, shapes, best_days, same_shapes):
            print(f"  {plans:6,} plans, floors {low:.4f}-{high:.4f}: {new:3} new trace shapes ({traced} in all)")


def rounds(floors: np.ndarray, shapes: np.ndarray, best: float, same_shapes: bool):
    """``(plans, lowest floor, highest floor, new shapes, shapes traced)`` per round of
    :func:`~vtrain_plugin.planning.bounded.best_first`, ``best`` found by the first."""
    order = np.lexsort((np.arange(len(floors)), floors))
    costed = np.zeros(len(floors), bool)
    traced = np.zeros(shapes.max() + 1, bool)
    size, cutoff = FIRST_ROUND_PLANS, np.inf
    while True:
        waiting = order[~costed[order] & (floors[order] <= cutoff)]
        chunk = waiting[:size]
        if not len(chunk):
            return
        new = len(set(shapes[chunk].tolist()) - set(np.flatnonzero(traced).tolist()))
        traced[shapes[chunk]] = True
        costed[chunk] = True
        if same_shapes and np.isfinite(cutoff):
            extra = np.flatnonzero(~costed & traced[shapes] & (floors <= cutoff))
            costed[extra] = True
            chunk = np.concatenate([chunk, extra])
        yield len(chunk), floors[chunk].min(), floors[chunk].max(), new, int(traced.sum())
        size, cutoff = size * 2, best


if __name__ == "__main__":
    main(*(float(a) for a in sys.argv[1:]))

"""A whole Megatron process layout inside one process: fake process group plus parallel_state.

``fake_world(plan, pipeline_rank=s)`` makes this process the representative rank of pipeline stage
``s`` (tensor-, context- and data-parallel rank 0) of a world of TP x CP x PP x DP ranks, with every megatron-core
process group created on the fake backend, and tears it all down on exit.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch.distributed as dist

from vtrain_plugin.core.errors import TraceError
from vtrain_plugin.core.graph import ParallelGroup
from megatron_adapters.conventions import global_rank
from vtrain_plugin.specs.parallel import ParallelPlan


def representative_rank(plan: ParallelPlan, pipeline_rank: int) -> int:
    """Global rank of (tp 0, cp 0, dp 0, pp ``pipeline_rank``) in megatron-core's rank order."""
    sizes = {ParallelGroup.TP: plan.tensor_parallel, ParallelGroup.CP: plan.context_parallel,
             ParallelGroup.DP: plan.data_parallel, ParallelGroup.PP: plan.pipeline_parallel}
    return global_rank({ParallelGroup.PP: pipeline_rank}, sizes)


@contextlib.contextmanager
def fake_world(plan: ParallelPlan, *, pipeline_rank: int = 0) -> Iterator[dict[str, ParallelGroup]]:
    """Yield a map from process-group name to the parallel group it stands for."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TraceError("torch.distributed is already initialized in this process; "
                         "vtrain traces on its own fake process group")
    # init_process_group wraps sys.excepthook to prefix every later traceback with "[rank<r>]:";
    # the fake world is gone after tracing, so its prefix must go too.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=representative_rank(plan, pipeline_rank),
                            world_size=plan.world_size)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=plan.tensor_parallel,
            pipeline_model_parallel_size=plan.pipeline_parallel,
            virtual_pipeline_model_parallel_size=plan.virtual_pipeline if plan.virtual_pipeline > 1 else None,
            context_parallel_size=plan.context_parallel,
            expert_model_parallel_size=plan.expert_parallel,
            expert_tensor_parallel_size=plan.expert_tensor_parallel,
            create_gloo_process_groups=False,
        )
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        yield _group_names(ps)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _group_names(ps) -> dict[str, ParallelGroup]:
    names: dict[str, ParallelGroup] = {}
    candidates = [
        (ps.get_tensor_model_parallel_group, ParallelGroup.TP),
        (ps.get_data_parallel_group, ParallelGroup.DP),
        (ps.get_pipeline_model_parallel_group, ParallelGroup.PP),
        (ps.get_embedding_group, ParallelGroup.EMBEDDING),
        # MoE layers: the router's load-balancing loss reduces over TP x CP. Chunks are traced
        # without CP (vtrain_plugin.capture.megatron_chunk), where that group is the TP ranks; with
        # CP it is neither group, and a collective on it is refused rather than mislabelled.
        *([(ps.get_tensor_and_context_parallel_group, ParallelGroup.TP)]
          if ps.get_context_parallel_world_size() == 1 else []),
        # Expert groups: megatron-core's expert rank generator (expert TP, EP, expert DP) over the
        # TP x CP x DP ranks of a pipeline stage (megatron_adapters.conventions.EXPERT_RANK_ORDER).
        (ps.get_expert_model_parallel_group, ParallelGroup.EP),
        (ps.get_expert_tensor_parallel_group, ParallelGroup.EXPERT_TP),
        (ps.get_expert_tensor_and_model_parallel_group, ParallelGroup.EXPERT_TP_EP),
        (ps.get_expert_data_parallel_group, ParallelGroup.EXPERT_DP),
        # The router's global auxiliary loss: its count all-reduce over every rank of the stage.
        (lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True), ParallelGroup.TP_DP_CP),
    ]
    for getter, group in candidates:
        try:
            pg = getter()
        except (AssertionError, RuntimeError):
            continue
        if pg is not None:
            names.setdefault(pg.group_name, group)
    return names


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """megatron-core warns on import about missing Apex/TransformerEngine; vtrain needs neither."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def reset_global_memory_buffer() -> None:
    """Megatron's global scratch buffer must not carry tensors from one model (or fake mode) to the next."""
    from megatron.core import parallel_state as ps

    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is not None:
        ps._GLOBAL_MEMORY_BUFFER = None
        ps._set_global_memory_buffer()

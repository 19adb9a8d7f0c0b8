"""Megatron-Core DDP's forward pre-hooks under ``overlap_param_gather``: host time on every module call
of the forward and the recompute, per micro-batch.

With the distributed optimizer and ``overlap_param_gather``, megatron-core 0.16's
``DistributedDataParallel`` registers a forward pre-hook on every module of the model
(``enable_forward_pre_hook``, distributed/distributed_data_parallel.py), and Megatron-LM keeps them on
after the first iteration. Each call of each module runs it: it walks the module's own parameters,
looks each up in ``param_to_bucket_group`` and calls ``finish_param_sync`` (which waits for the
bucket's all-gather once per step and returns at once after), and ``nn.Module.__call__`` takes its
slow path for the hook. The hook is priced per module call at :data:`PRE_HOOK_NS` of host time,
measured on the CPU (``python -m benchmarks.accuracy.ddp_host_time``: a megatron-core GPT wrapped in
megatron-core's own DDP, its forward with and without the hooks: 5.2-6.7 us a call over five runs;
``benchmarks/results/2026-12-04_ddp_host_costs.txt``), times the node's ``host_time_factor``.

The modules called are those that issue the segment's kernels (the rows' modules, as the stack
lowers them) and the modules above them inside the block (a layer, its attention and MLP): each once
per segment, its hook before its first kernel. Modules that issue no kernel (identity norms and
bias-dropout-adds) and the model's containers above a block (the ``GPTModel``, its
``TransformerBlock``, called once per chunk) are not counted. Under CUDA graphs a captured module's
forward does not run, nor does its hook (the captured rows' host cost is replaced by the graph
launch, :mod:`vtrain_plugin.cost.cuda_graphs`). Why: small layers are host-bound, and a hook on
each of their some 15 modules is a host cost per micro-batch the module constants do not hold (a
run without the hooks pays the same module calls).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_adapters.conventions import LOSS
from vtrain_plugin.core.graph import Block, Phase
from vtrain_plugin.cost.kernels.host_device import Segment
from vtrain_plugin.specs.training import TrainingSpec

# Host time of one forward pre-hook call: the median of the five CPU runs above.
PRE_HOOK_NS = 5_900.0
_HOOKED_PHASES = (Phase.FORWARD, Phase.RECOMPUTE)


def forward_pre_hooks(training: TrainingSpec) -> bool:
    """Whether megatron-core's DDP puts its parameter-gather pre-hook on every module: the distributed
    optimizer with ``overlap_param_gather`` (Megatron-FSDP gathers its parameters by hooks of its own)."""
    return training.distributed_optimizer and training.overlap_param_gather and training.fsdp is None


def hook_calls(modules: Sequence[str], segments: Sequence[Segment], blocks: Sequence[Block]) -> np.ndarray:
    """Per row, the module calls whose pre-hooks run before it (see the module doc): in each forward
    and recompute segment, at the first row of a module, that module and those above it inside the
    block that were not called before it in the segment. ``modules`` is each row's module."""
    calls = np.zeros(len(modules))
    for s in segments:
        if s.phase not in _HOOKED_PHASES:
            continue
        top = blocks[s.block].name
        seen: set[str] = set()
        for row in range(s.start, s.stop):
            name = modules[row]
            if not name or name == LOSS or name in seen:
                continue
            new = 0
            while name and name not in seen:
                seen.add(name)
                new += 1
                if name == top or not name.startswith(f"{top}."):
                    break
                name = name.rpartition(".")[0]
            calls[row] = new
    return calls

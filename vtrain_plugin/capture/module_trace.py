"""Tracing a plain ``torch.nn.Module`` on the meta device, as one stage: ``trace(module, sample_input=...)``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from vtrain_plugin.capture import folding
from vtrain_plugin.capture.recorder import OpRecorder
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.specs.parallel import ParallelPlan


def trace_module(module: torch.nn.Module, sample_input: Any, loss_fn: Callable | None, *,
                 seq_length: int | None) -> OpGraph:
    """Trace a plain module on the meta device: forward, loss, backward, Adam step, one stage. The
    sample input is one micro-batch."""
    meta = copy.deepcopy(module).to("meta")
    inputs = _to_meta(sample_input if isinstance(sample_input, (tuple, list)) else (sample_input,))
    recorder = OpRecorder(meta)
    params = [p for p in meta.parameters() if p.requires_grad]
    with recorder.recording():
        with recorder.phase(Phase.FORWARD):
            output = meta(*inputs)
            with recorder.module("loss"):
                loss = loss_fn(output) if loss_fn is not None else output.float().mean()
        with recorder.phase(Phase.BACKWARD):
            loss.backward()
        with recorder.paused():
            optimizer = torch.optim.Adam(params, foreach=False)
        with recorder.phase(Phase.OPTIMIZER), recorder.module("optimizer"):
            optimizer.step()
    nodes = [folding.to_node(r, lambda name: ParallelGroup.DP) for r in recorder.records]
    block = Block(kind=BlockKind.STAGE, name="model", nodes=tuple(nodes),
                  num_parameters=sum(p.numel() for p in params), parameter_numels=tuple(p.numel() for p in params))
    stage = StageGraph(pipeline_rank=0, blocks=(block,))
    first = inputs[0] if inputs else None
    batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
    if seq_length is None:
        token_ids = isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point()
        seq_length = int(first.shape[1]) if token_ids else 0
    elif not (isinstance(seq_length, int) and seq_length > 0):
        raise ConfigError(f"seq_length must be a positive integer, got {seq_length!r}")
    return OpGraph(model=None, module_name=type(module).__name__, parallel=ParallelPlan(micro_batch_size=batch),
                   micro_batch_size=batch, seq_length=seq_length, stages=(stage,))


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return tuple(_to_meta(v) for v in value)
    return value

"""Tracing a plain ``torch.nn.Module`` on the meta device, as one stage: ``trace(module, sample_input=...)``.

The module is run with meta stand-ins for its parameters and buffers
(``torch.func.functional_call``), never copied: a module that holds what cannot be copied or
pickled (process groups, file handles, locks) traces too, and its own tensors are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vtrain_plugin.capture import folding
from vtrain_plugin.capture.recorder import OpRecorder
from vtrain_plugin.capture.sample_input import as_arguments, sample_shape
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.specs.parallel import ParallelPlan


def trace_module(module: torch.nn.Module, sample_input: Any, loss_fn: Callable | None, *,
                 seq_length: int | None) -> OpGraph:
    """Trace a plain module on the meta device: forward, loss, backward, Adam step, one stage. The
    sample input is one micro-batch."""
    originals = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    stand_ins = {name: _meta_like(t) for name, t in originals.items()}
    inputs = _to_meta(as_arguments(sample_input))
    recorder = OpRecorder(module, stand_ins={id(originals[name]): t for name, t in stand_ins.items()})
    params = [stand_ins[name] for name, p in module.named_parameters() if p.requires_grad]
    with recorder.recording():
        with recorder.phase(Phase.FORWARD):
            output = torch.func.functional_call(module, stand_ins, inputs)
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
    shape = sample_shape(sample_input)
    batch = shape.micro_batch_size
    if seq_length is None:
        seq_length = shape.seq_length or 0
    elif not (isinstance(seq_length, int) and seq_length > 0):
        raise ConfigError(f"seq_length must be a positive integer, got {seq_length!r}")
    return OpGraph(model=None, module_name=type(module).__name__, parallel=ParallelPlan(micro_batch_size=batch),
                   micro_batch_size=batch, seq_length=seq_length, stages=(stage,))


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A leaf on the meta device with ``tensor``'s shape, dtype and ``requires_grad``."""
    return tensor.detach().to("meta").requires_grad_(tensor.requires_grad)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return tuple(_to_meta(v) for v in value)
    return value

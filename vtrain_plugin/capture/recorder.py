"""Record every aten op and c10d collective of a training step, attributed to module and phase.

A private ``TorchDispatchMode`` sees each op below autograd. Forward ops take the module on top of
a stack kept by forward hooks. Backward ops take the module that created the autograd node being
run: when a module's forward returns, the nodes it created (those with a sequence number at or
above the one current when it started, not yet claimed by an inner module) are tagged with its
name (inner modules' hooks run first, so the innermost module wins). A module forward that runs while backward is in progress is activation recompute.
The bytes the step's ops hold are followed too (:mod:`~vtrain_plugin.capture.live_memory`).
A fake tensor's metadata queries (``prim.device``, ``prim.layout``) are not recorded: they launch no
kernel and hold no bytes, and autograd makes them only with grad on, so a no-grad forward (activation
checkpointing) would otherwise differ from the same forward with grad in ops that cost nothing.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops
from torch.utils._python_dispatch import TorchDispatchMode

from vtrain_plugin.capture import opinfo
from vtrain_plugin.capture.live_memory import LiveMemory
from vtrain_plugin.capture.records import CollectiveRecord, OpRecord, Record
from vtrain_plugin.core.errors import TraceError
from vtrain_plugin.core.graph import CollectiveKind, Phase
from megatron_adapters.conventions import SHARED_BY_CORE_ATTENTION, is_core_attention_module, split_layer_module

_TAG = "vtrain_module"

_COLLECTIVE_KINDS = {
    "allreduce_": CollectiveKind.ALL_REDUCE,
    "all_reduce": CollectiveKind.ALL_REDUCE,
    "all_reduce_": CollectiveKind.ALL_REDUCE,
    "_allgather_base_": CollectiveKind.ALL_GATHER,
    "allgather_": CollectiveKind.ALL_GATHER,
    "all_gather_into_tensor": CollectiveKind.ALL_GATHER,
    "_reduce_scatter_base_": CollectiveKind.REDUCE_SCATTER,
    "reduce_scatter_": CollectiveKind.REDUCE_SCATTER,
    "reduce_scatter_tensor": CollectiveKind.REDUCE_SCATTER,
    "send": CollectiveKind.SEND,
    "recv_": CollectiveKind.RECV,
    "alltoall_": CollectiveKind.ALL_TO_ALL,
    "alltoall_base_": CollectiveKind.ALL_TO_ALL,
    "all_to_all_single": CollectiveKind.ALL_TO_ALL,
    "broadcast_": CollectiveKind.BROADCAST,
    "broadcast": CollectiveKind.BROADCAST,
}


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, owner: OpRecorder) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.owner.enabled:
            self.owner._record(func, args, kwargs, out)
        return out


class OpRecorder:
    """Attach to a module tree, then run a step inside :meth:`recording` and read :attr:`records`."""

    def __init__(self, root: torch.nn.Module, *, prefix: str = "",
                 stand_ins: Mapping[int, torch.Tensor] | None = None) -> None:
        """``stand_ins``: the tensors that run in place of ``root``'s parameters, by the ``id`` of
        the parameter each stands for (``torch.func.functional_call``); none: the parameters run."""
        stand_ins = stand_ins or {}
        self.records: list[Record] = []
        self.enabled = True
        self._phase = Phase.FORWARD
        self._stack: list[tuple[str, int]] = []
        self._handles: list[Any] = []
        self._param_owner: dict[int, str] = {}
        self.saved_nbytes: dict[str, int] = {}  # activation bytes kept for backward, per module
        self._saved_storages: set[int] = set()  # their storage keys
        self._saved: list[weakref.ref[_SavedTensor]] = []  # in the order forward saved them
        self._last_layer = ""  # the transformer layer whose forward started last
        self._params = [stand_ins.get(id(p), p) for p in root.parameters()]
        # held, so that while the recorder lives no op's storage takes the key of one whose parameter
        # was given other data (``.data =``)
        self._param_storage_refs = [p.untyped_storage() for p in self._params]
        self._param_storages: set[int] = {s._cdata for s in self._param_storage_refs}
        self._live = LiveMemory(self._param_storages)
        # Bytes alive beside the saved activations when the backward began, and the most the backward
        # (its recompute included, the parameters' gradients left out) rose above that level;
        # measured when the backward ends (StageGraph.held_nbytes, backward_peak_nbytes)
        self.held_nbytes = 0
        self.backward_peak_nbytes = 0
        # the same without the storages core attentions create (LiveMemory)
        self.held_outside_attention_nbytes = 0
        self.backward_peak_outside_attention_nbytes = 0
        # the backward's peak with torch's GPU softmax-backward temporaries (LiveMemory)
        self.gpu_softmax_backward_peak_nbytes = 0
        self._backward_measured = False
        self._module_override: str | None = None
        self._default_module = ""
        # per op overload (by id: opinfo holds them) and per module name, what _record asks on every op
        self._collective_ops: dict[int, bool] = {}
        self._in_core_attention: dict[str, bool] = {}
        for name, module in root.named_modules(prefix=prefix):
            self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._make_post_hook(name)))
            for p in module.parameters(recurse=False):
                self._param_owner[id(stand_ins.get(id(p), p))] = name

    # -- public -----------------------------------------------------------------------------
    def param_owner(self, param: torch.Tensor) -> str:
        return self._param_owner.get(id(param), "")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        mode = _DispatchRecorder(self)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._on_saved_tensor, _unpack)
        try:
            with mode, hooks:
                yield
            self._measure_backward()  # a step without an optimizer phase
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def phase(self, phase: Phase) -> contextlib.AbstractContextManager[None]:
        if phase is Phase.BACKWARD and not self.saved_nbytes:
            self._count_saved_activations()
        if phase is Phase.BACKWARD:
            self._live.begin_backward(self._saved_storages)
        if phase is Phase.OPTIMIZER:  # the gradients are still the parameters' .grad
            self._measure_backward()
        return self._setting("_phase", phase)

    def _measure_backward(self) -> None:
        if self._backward_measured:
            return
        self._backward_measured = True
        grads = [p.grad for p in self._params if p.grad is not None]
        self.backward_peak_nbytes = self._live.backward_peak(grads)
        self.backward_peak_outside_attention_nbytes = self._live.backward_peak(grads, outside_attention=True)
        self.gpu_softmax_backward_peak_nbytes = self._live.backward_peak(grads, gpu_softmax=True)
        self.held_nbytes = self._live.held_nbytes
        self.held_outside_attention_nbytes = self._live.held_outside_attention_nbytes

    def module(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Attribute ops run outside any module forward (e.g. optimizer steps) to ``name``."""
        return self._setting("_module_override", name)

    def default_module(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Attribute ops that no module claims (e.g. autograd seeding the loss gradient) to ``name``."""
        return self._setting("_default_module", name)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self._setting("enabled", False)

    @contextlib.contextmanager
    def _setting(self, attribute: str, value: Any) -> Iterator[None]:
        previous = getattr(self, attribute)
        setattr(self, attribute, value)
        try:
            yield
        finally:
            setattr(self, attribute, previous)

    # -- hooks ------------------------------------------------------------------------------
    def _next_sequence_nr(self) -> int:
        """The sequence number autograd gives the next node it creates (per thread, rising): read,
        not taken, so no probe node (and no fake tensor) is made per module call."""
        return torch._C._autograd._get_sequence_nr()

    def _make_pre_hook(self, name: str) -> Callable:
        layer = split_layer_module(name)
        is_layer = layer is not None and not layer[2]

        def hook(module, inputs):
            if is_layer:
                self._last_layer = name
            self._stack.append((name, self._next_sequence_nr()))
        return hook

    def _make_post_hook(self, name: str) -> Callable:
        def hook(module, inputs, output):
            _, start = self._stack.pop()
            self._tag_created_nodes(output, name, start)
        return hook

    def _tag_created_nodes(self, output: Any, name: str, start: int) -> None:
        roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while roots:
            node = roots.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            meta = node.metadata
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad of a parameter
                meta.setdefault(_TAG, self._param_owner.get(id(variable), name))
                continue
            if node._sequence_nr() < start:
                continue
            # Inner modules tagged their nodes first; walk through them to reach this module's own.
            meta.setdefault(_TAG, name)
            roots.extend(fn for fn, _ in node.next_functions)

    def _on_saved_tensor(self, tensor: torch.Tensor) -> Any:
        """Wrap each tensor autograd saves in forward; :meth:`_count_saved_activations` later sums the
        wrappers still alive, i.e. what the graph really keeps for backward (tensors saved by
        functions run under no-grad, as inside activation checkpointing, are freed at once).

        A save by a container of the layers (``decoder``: activation checkpointing saves a layer's
        inputs there, after running the layer) belongs to the layer that just ran."""
        if not (self.enabled and self._phase is Phase.FORWARD):
            return tensor
        module = self._stack[-1][0] if self._stack else self._default_module
        if module and self._last_layer.startswith(module + "."):
            module = self._last_layer
        saved = _SavedTensor(tensor, module)
        self._saved.append(weakref.ref(saved))
        return saved

    def _count_saved_activations(self) -> None:
        """Bytes of every saved storage (parameters excluded), each counted once: for the module
        that saved it first, or, when modules of several layers saved it (the attention mask, an
        input of the whole chunk), for the chunk (:func:`_owner`), so that a layer template stands
        for a layer alone. Walking the saves in order (after collecting unreachable cycles) makes
        the attribution deterministic."""
        gc.collect()
        savers: dict[int, list[str]] = {}
        sizes: dict[int, int] = {}
        for ref in self._saved:
            saved = ref()
            if saved is None:
                continue
            storage = saved.tensor.untyped_storage()
            key = storage._cdata
            if key in self._param_storages:
                continue
            savers.setdefault(key, []).append(saved.module)
            sizes[key] = storage.nbytes()
        self._saved_storages = set(sizes)
        for key, modules in savers.items():
            owner = _owner(modules)
            self.saved_nbytes[owner] = self.saved_nbytes.get(owner, 0) + sizes[key]

    # -- recording --------------------------------------------------------------------------
    def _current(self) -> tuple[Phase, str]:
        if self._module_override is not None:
            return self._phase, self._module_override
        if self._phase is Phase.BACKWARD:
            if self._stack:
                return Phase.RECOMPUTE, self._stack[-1][0]
            node = torch._C._current_autograd_node()
            module = node.metadata.get(_TAG, "") if node is not None else ""
            return Phase.BACKWARD, module or self._default_module
        return self._phase, (self._stack[-1][0] if self._stack else self._default_module)

    def _record(self, func, args, kwargs, out) -> None:
        info = opinfo.op_info(func)
        if info.prim:  # a fake tensor's device or layout: no kernel, no bytes (no tensor), not recorded
            return
        collective = self._collective_ops.get(id(func))
        if collective is None:
            collective = self._collective_ops[id(func)] = func in collective_ops
        phase, module = self._current()
        attention = self._in_core_attention.get(module)
        if attention is None:
            attention = self._in_core_attention[module] = is_core_attention_module(module)
        self._live.saw(func, out, attention)
        if collective:
            self.records.append(self._collective(func, args, kwargs, out, phase, module))
            return
        kernel = opinfo.launches_kernel(func, args, kwargs, out)
        self.records.append(OpRecord(
            key=opinfo.kernel_key(func, args, kwargs),
            phase=phase,
            module=module,
            output_shapes=opinfo.output_shapes(out),
            launches_kernel=kernel,
            flops=opinfo.flops(func, args, kwargs, out) if kernel else 0,
            nbytes=opinfo.moved_nbytes(args, kwargs, out) if kernel else 0,
        ))

    def _collective(self, func, args, kwargs, out, phase, module) -> CollectiveRecord:
        base = func._schema.name.split("::")[-1]
        kind = _COLLECTIVE_KINDS.get(base)
        if kind is None:
            raise TraceError(f"collective {func} is not supported by the tracer (no CollectiveKind for it)")
        group = CollectiveOp.get_process_group(func, args)
        tensors = _tensors(args)
        nbytes = _collective_nbytes(kind, func, args, out)
        return CollectiveRecord(
            kind=kind,
            nbytes=nbytes,
            group_name=group.group_name,
            group_size=group.size(),
            phase=phase,
            module=module,
            dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
        )


def _collective_nbytes(kind: CollectiveKind, func, args, out) -> int:
    """NCCL's message size: the full (gathered / pre-scatter) tensor for all-gather and reduce-scatter."""
    if kind is CollectiveKind.ALL_GATHER and func is torch.ops.c10d._allgather_base_.default:
        return opinfo.tensor_nbytes(args[0])
    if kind is CollectiveKind.REDUCE_SCATTER and func is torch.ops.c10d._reduce_scatter_base_.default:
        return opinfo.tensor_nbytes(args[1])
    if kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST, CollectiveKind.SEND,
                CollectiveKind.RECV, CollectiveKind.ALL_TO_ALL):
        return opinfo.tensor_nbytes(args[0])
    return max(opinfo.tensor_nbytes(args[0]), opinfo.tensor_nbytes(args[1]))


class _SavedTensor:
    __slots__ = ("tensor", "module", "__weakref__")

    def __init__(self, tensor: torch.Tensor, module: str) -> None:
        self.tensor = tensor
        self.module = module


def _owner(savers: list[str]) -> str:
    """The module a saved storage's bytes are attributed to, from the modules that saved it, in order:
    the first when they are all in one layer; :data:`SHARED_BY_CORE_ATTENTION` when they are the core
    attention of several layers (the causal mask: a stack with fused attention keeps none); else the
    chunk (``""``). In a chunk of one layer nothing tells the shared mask from the layer's own
    tensors: it stays with the layer, and is counted under fused attention too (``s^2`` bytes)."""
    if len({_layer_of(m) for m in savers}) == 1:
        return savers[0]
    if all(is_core_attention_module(m) for m in savers):
        return SHARED_BY_CORE_ATTENTION
    return ""


def _layer_of(module: str) -> str:
    """The transformer layer ``module`` is in, or ``module`` itself outside the layers."""
    layer = split_layer_module(module)
    return f"{layer[0]}.{layer[1]}" if layer else module


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _SavedTensor) else saved


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []

"""The bytes a traced step holds op by op: what the backward pass (and the recompute inside it) adds
above the activations saved for it, module by module.

Every storage an op creates is counted from its first tensor until its last tensor dies (a weak
reference on each tensor that uses it; a fake tensor dies exactly when the real one would, as
autograd frees saved tensors after their node runs). Parameters' storages and tensors made before
recording are never counted; a parameter's gradient (``.grad``, which the trace keeps where
Megatron's DDP adds it into its gradient buffer and frees it) is left out of the whole backward.

Both are also measured without the storages that ops of a core attention create (its global score
buffer, its score-sized tensors and their gradients, in forward, recompute and backward alike): what
a stack whose fused attention kernel allocates none of those holds (its own outputs and gradients,
the size of queries, keys and values, are left out with them).

One op allocates more than its outputs while it runs: the softmax backward
(``_softmax_backward_data``), whose CUDA kernel computes ``grad * output`` into a temporary of its
output's size before it reduces it (on the lent H200, torch 2.11, 1,024 keys: the temporary is live
at the peak of a recomputed attention's backward). The CPU kernel that runs the trace fuses that
product and the fused softmax kernels of the other stacks make none, so the peak is measured both
ways: :meth:`LiveMemory.backward_peak` counts it live while the op's output is made only when asked.

Why: the saved activations are not the peak. Under full recompute the backward of each layer runs
its forward again and keeps all of that layer's activations while it back-propagates through them,
with the gradients in flight (score-sized ones in an unfused attention), and megatron-core's local
attention keeps a global buffer of scores that no saved tensor counts: the step's real peak is the
stash plus those. Measured on the traced step, they are what megatron-core does, op for op.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


# per op overload, by its id (the overload held so the id stays its own): the overload, and whether it
# returns an alias of an input (a view, an in-place result)
_aliasing: dict[int, tuple] = {}
_SOFTMAX_BACKWARD = torch.ops.aten._softmax_backward_data.default  # its GPU kernel's temporary (module doc)


class LiveMemory:
    """Counts the storages of op outputs: :attr:`held_nbytes` and :meth:`backward_peak`, with and
    without what core attentions allocate."""

    def __init__(self, excluded: set[int]) -> None:
        self._excluded = excluded  # storage keys never counted (the parameters')
        # key -> [nbytes, tensors alive, allocation id, the storage]: the entry holds its storage, so
        # that no other storage takes its key while it lives (a tensor can outlive the storage it was
        # made with: megatron-core's make_viewless_tensor swaps a fresh tensor's ``.data``)
        self._storages: dict[int, list] = {}
        self._events: list[tuple[int, int]] = []  # (allocation id, +/- bytes), in order
        self._backward_start: int | None = None  # events before the backward began
        self._attention: set[int] = set()  # allocation ids created by a core attention's ops
        self._temporaries: set[int] = set()  # allocation ids of the GPU softmax backward's temporaries
        self.held_nbytes = 0  # alive when the backward began, in no saved tensor
        self.held_outside_attention_nbytes = 0  # of those, not created by a core attention
        self._allocations = 0

    def saw(self, func, out, attention: bool = False) -> None:
        """Count the storages ``func`` created (not those of a view or in-place result of an
        uncounted tensor) and follow every output tensor to its death; ``attention``: ``func`` runs
        in a core attention."""
        known = _aliasing.get(id(func))
        if known is None:
            known = _aliasing[id(func)] = (func, any(r.alias_info is not None for r in func._schema.returns))
        aliasing = known[1]
        for tensor in _tensors(out):
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no storage of one piece
                continue
            key = storage._cdata
            entry = self._storages.get(key)
            if entry is None:
                if aliasing or key in self._excluded:
                    continue
                self._allocations += 1
                entry = self._storages[key] = [storage.nbytes(), 0, self._allocations, storage]
                self._events.append((entry[2], entry[0]))
                if attention:
                    self._attention.add(entry[2])
            entry[1] += 1
            weakref.finalize(tensor, self._release, key, entry[2])
        if func is _SOFTMAX_BACKWARD and isinstance(out, torch.Tensor):
            self._transient(out.untyped_storage().nbytes(), attention)

    def _transient(self, nbytes: int, attention: bool) -> None:
        """A temporary an op allocates and frees while it runs, live beside its outputs."""
        self._allocations += 1
        self._events.append((self._allocations, nbytes))
        self._events.append((self._allocations, -nbytes))
        self._temporaries.add(self._allocations)
        if attention:
            self._attention.add(self._allocations)

    def _release(self, key: int, allocation: int) -> None:
        entry = self._storages.get(key)
        if entry is None or entry[2] != allocation:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self._events.append((allocation, -entry[0]))

    def begin_backward(self, saved: set[int]) -> None:
        """The backward begins; ``saved``: the storage keys of the tensors saved for it."""
        self._backward_start = len(self._events)
        held = [(nbytes, allocation) for key, (nbytes, _, allocation, _) in self._storages.items() if key not in saved]
        self.held_nbytes = sum(nbytes for nbytes, _ in held)
        self.held_outside_attention_nbytes = sum(nbytes for nbytes, a in held if a not in self._attention)

    def backward_peak(self, gradients: Iterable[torch.Tensor], *, outside_attention: bool = False,
                      gpu_softmax: bool = False) -> int:
        """The most the bytes alive rose above their level when the backward began, without the
        storages of ``gradients`` (the parameters' ``.grad`` now), with ``outside_attention``
        without those a core attention created, and with ``gpu_softmax`` with the temporaries of
        torch's GPU softmax backward (see the module doc); 0 before any backward."""
        if self._backward_start is None:
            return 0
        skipped = {self._storages[k][2] for k in (g.untyped_storage()._cdata for g in gradients) if k in self._storages}
        if outside_attention:
            skipped |= self._attention
        if not gpu_softmax:
            skipped |= self._temporaries
        live = peak = 0
        for allocation, delta in self._events[self._backward_start:]:
            if allocation not in skipped:
                live += delta
                peak = max(peak, live)
        return peak


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []

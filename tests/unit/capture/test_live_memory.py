"""The live-bytes count of a traced step, op by op on fake tensors: views share their storage, a
storage dies with its last tensor, parameters and their gradients are left out."""

import gc
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from vtrain_plugin.capture.live_memory import LiveMemory

N = 64 * 256 * 4  # bytes of one (64, 256) fp32 tensor


class _Feed(TorchDispatchMode):
    def __init__(self, live: LiveMemory) -> None:
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live.saw(func, out)
        return out


def test_views_share_a_storage_that_dies_with_its_last_tensor():
    with FakeTensorMode():
        x, w = torch.empty(64, 128), torch.empty(128, 256)
        live = LiveMemory({w.untyped_storage()._cdata})
        with _Feed(live):
            y = x @ w  # one new storage
            view = y.view(-1)  # the same storage
            w.t()  # a view of the parameter: never counted
            live.begin_backward(saved=set())
            assert live.held_nbytes == N  # y, in no saved tensor
            del y  # the view keeps it
            z = view * 2  # +N: the peak
            del view, z
            grad = torch.ones(64, 256)  # a parameter's gradient: left out
            peak = live.backward_peak([grad])
    assert peak == N


def test_saved_storages_are_not_held():
    with FakeTensorMode():
        x = torch.empty(64, 256)
        live = LiveMemory(set())
        with _Feed(live):
            y = x * 3
            kept = x + 1
            live.begin_backward(saved={kept.untyped_storage()._cdata})
            assert live.held_nbytes == N  # y alone
            del y, kept
            assert live.backward_peak([]) == 0  # only frees after the start




def test_a_storage_swapped_out_of_its_tensor_lives_until_the_tensor_dies():
    """megatron-core's make_viewless_tensor gives a fresh one-element tensor another tensor's data:
    the storage it was made with stays counted, and held, while the tensor lives, so that no later
    storage is made at its address and taken for it (never counted)."""
    with FakeTensorMode():
        x = torch.empty(64, 256)
        live = LiveMemory(set())
        with _Feed(live):
            live.begin_backward(saved=set())
            out = torch.empty(1)  # +4 bytes
            own = weakref.ref(out.untyped_storage())
            out.data = x.data  # the tensor drops its own storage
            held_beside_the_tensor = own() is not None
            made = [torch.empty(64, 256) for _ in range(64)]  # each +N, none at the dropped one's address
            peak = live.backward_peak([])
            del out
            gc.collect()
            freed_with_the_tensor = own() is None
    assert held_beside_the_tensor and freed_with_the_tensor
    assert len(made) == 64 and peak == 4 + 64 * N

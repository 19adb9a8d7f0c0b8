"""The live-bytes count of a traced step, op by op on fake tensors: views share their storage, a
storage dies with its last tensor, parameters and their gradients are left out."""

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

"""benchmarks/device/memory_at_peak.py's replay of an allocator history: the peak and what is live then."""

from benchmarks.device.memory_at_peak import allocation_site, peak_live_blocks, report

GIB = 2**30
TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}
MLP = {"filename": "/tmp/site/megatron/core/transformer/mlp.py", "line": 224, "name": "glu"}


def _alloc(addr, gib, frames=()):
    return {"action": "alloc", "addr": addr, "size": gib * GIB, "frames": list(frames)}


def _free(addr):
    return [{"action": "free_requested", "addr": addr}, {"action": "free_completed", "addr": addr}]


def test_the_peak_is_the_live_set_before_the_first_free_after_the_highest_total():
    events = [_alloc(1, 4, [TORCH, MLP]), _alloc(2, 2), *_free(2), _alloc(3, 1), _alloc(4, 3), *_free(1), _alloc(5, 1)]
    peak, live, at = peak_live_blocks(events)
    assert peak == 8 * GIB  # 4 + 1 + 3 after block 2 was freed beats 4 + 2
    assert sorted(live) == [1, 3, 4]
    assert at == 5


def test_blocks_freed_only_when_completed_and_unknown_frees_ignored():
    events = [_alloc(1, 2), {"action": "free_requested", "addr": 1}, _alloc(2, 1), *_free(9)]
    peak, live, _ = peak_live_blocks(events)
    assert peak == 3 * GIB and sorted(live) == [1, 2]


def test_allocation_site_skips_torch_frames_and_names_the_package_path():
    assert allocation_site([TORCH, MLP]) == "megatron/core/transformer/mlp.py:224 glu"
    assert allocation_site([TORCH]) == "(inside torch)"


def test_report_groups_by_site_and_accounts_for_the_rest():
    live = {1: (3 * GIB, [MLP]), 2: (1 * GIB, [TORCH, MLP]), 3: (2 * GIB, [TORCH])}
    text = report("plan", 6 * GIB, live, 6 * GIB, 5.5, top=1).splitlines()
    assert text[0] == ("## plan: peak allocated 6.000 GiB from the replayed history, 6.000 GiB "
                       "max_memory_allocated; the estimate's tensors 5.500 GiB")
    assert text[2] == "   4.000       2  megatron/core/transformer/mlp.py:224 glu"
    assert text[3] == "   2.000          (the other 1 sites)"

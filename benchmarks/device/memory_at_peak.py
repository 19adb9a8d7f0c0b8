"""Where a real training step's peak allocated memory goes, on a GPU: the tensors live at the peak,
grouped by the code that allocated them.

    python -m benchmarks.device.memory_at_peak --plans NAME,... [--out PATH]

For each plan of ``h100_validation.py``'s catalogue the real step (megatron-core's local spec, the
mixed-precision AdamW vtrain estimates) trains one warm-up and one measured iteration with PyTorch's
allocation history recorded (``torch.cuda.memory._record_memory_history``, Python stacks). The
history is replayed to find the moment the allocated bytes peak (what ``max_memory_allocated``
reports, checked against it), and the blocks live then are summed by the innermost frame outside
``torch/`` that allocated them (a megatron-core module, the adapter's optimizer, the loss), beside
the estimate's peak. Why: the estimate's memory error on a plan says by how much it is off; this
says which tensors make the difference, which the measured peak alone cannot.

Needs a CUDA device, PyTorch and megatron-core (carried as a wheel: see ``h100_validation.py``).
Writes the report to ``--out`` (text, atomically) and prints it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Iterable

GIB = 2**30


def peak_live_blocks(events: Iterable[dict[str, Any]]) -> tuple[int, dict[int, tuple[int, list[dict]]], int]:
    """Replay an allocator trace: (peak allocated bytes, the blocks live at that moment by address, the
    index of the event that reached it). A block counts from its ``alloc`` to its ``free_completed``
    (the caching allocator's allocated-bytes statistic does the same)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = peak_at = 0
    peak_live: dict[int, tuple[int, list[dict]]] = {}
    pending_copy = False
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, peak_at, pending_copy = total, index, True
        elif action == "free_completed" and event["addr"] in live:
            if pending_copy:  # the live set is copied only when the peak is left, not at every new high
                peak_live, pending_copy = dict(live), False
            total -= live.pop(event["addr"])[0]
    if pending_copy:
        peak_live = dict(live)
    return peak, peak_live, peak_at


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame of a block's stack outside PyTorch itself: file (from the package root),
    line and function."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" in name or name.startswith("<") or "memory_at_peak" in name:
            continue
        for root in ("/megatron/", "/megatron_adapters/", "/vtrain_plugin/", "/benchmarks/"):
            if root in name:
                name = root.strip("/") + "/" + name.split(root, 1)[1]
                break
        return f"{name}:{frame.get('line')} {frame.get('name')}"
    return "(inside torch)"


def report(name: str, peak: int, live: dict[int, tuple[int, list[dict]]], measured_peak: int, predicted_gib: float,
           top: int = 30) -> str:
    by_site: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for size, frames in live.values():
        site = allocation_site(frames)
        by_site[site] += size
        count[site] += 1
    lines = [f"## {name}: peak allocated {peak / GIB:.3f} GiB from the replayed history, "
             f"{measured_peak / GIB:.3f} GiB max_memory_allocated; the estimate's tensors {predicted_gib:.3f} GiB",
             f"{'GiB':>8}  {'blocks':>6}  allocated at"]
    shown = 0
    for site, size in by_site.most_common(top):
        lines.append(f"{size / GIB:8.3f}  {count[site]:6d}  {site}")
        shown += size
    lines.append(f"{(peak - shown) / GIB:8.3f}  {'':>6}  (the other {max(0, len(by_site) - top)} sites)")
    return "\n".join(lines)


def run_plan(name: str, mapping: dict[str, Any]) -> str:
    import torch

    from megatron_adapters.real_model import train
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.measured.one_device import single_device_run
    from vtrain_plugin.runs import run_config_from_dict

    run = run_config_from_dict(mapping, source=name)
    single, _ = single_device_run(run, "cuda")
    predicted = estimate(single).memory_gib[0].tensors_gib
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    try:
        train(single.model, single.parallel, num_microbatches=single.num_microbatches, iterations=1, warmup=1,
              device="cuda")
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    events = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live, _ = peak_live_blocks(events)
    return report(name, peak, live, measured, predicted)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.device.h100_validation import PLANS
    from vtrain_plugin.core.files import atomic_write_text

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", required=True, help=f"comma-separated subset of: {', '.join(PLANS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        parser.error(f"--plans: unknown plan {unknown[0]!r}; known: {', '.join(PLANS)}")
    sections = []
    for name in names:
        try:
            sections.append(run_plan(name, PLANS[name]))
        except Exception as exc:  # one plan out of memory must not lose the others
            sections.append(f"## {name}: FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        print(sections[-1], flush=True)
        if args.out is not None:
            atomic_write_text(args.out, "\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

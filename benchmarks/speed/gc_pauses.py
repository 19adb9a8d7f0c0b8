"""Python's garbage-collector pauses in a megatron-core GPT's training step on the CPU: what
Megatron-LM's --manual-gc takes out of the steps between its collections.

Times, with ``gc.callbacks``, every automatic collection during forward, backward and the optimizer
step of a small GPT (real tensors, host-bound: Python and dispatch dominate as in the functional
tests), and counts the aten ops the step dispatches, giving the pause per step and per op; then the
same steps with the collector disabled (process CPU seconds, interleaved rounds), and one full
``gc.collect()`` at the end, what --manual-gc-interval pays every N steps.
Run: ``PYTHONPATH=$PWD python -m benchmarks.speed.gc_pauses [--rounds 5 --steps 20]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_adapters.conventions import ChunkRole
from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
from megatron_adapters.gpt import build_chunk
from megatron_adapters.real_model import _device_patches, random_micro_batch
from megatron_adapters.training_step import AdamSettings, MixedPrecisionAdamW, forward_backward
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = ModelSpec(name="gc-probe", num_layers=args.layers, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=512, dtype="fp32")
    plan = ParallelPlan(micro_batch_size=1)
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            pauses.append(time.perf_counter_ns() - started[0])

    with quiet_megatron(), _device_patches(torch.device("cpu")), fake_world(plan):
        reset_global_memory_buffer()
        gpt = build_chunk(model, plan, ChunkRole(pipeline_rank=0, chunk=0, pre_process=True, post_process=True),
                          layers_per_chunk=model.num_layers)
        gpt.train()
        optimizer = MixedPrecisionAdamW(gpt.parameters(), AdamSettings())
        generator = torch.Generator().manual_seed(0)
        batch = random_micro_batch(1, model.seq_length, model.vocab_size, torch.device("cpu"), generator)

        def step() -> None:
            forward_backward(gpt, batch, num_microbatches=1, loss_scale=optimizer.loss_scale)
            optimizer.step()

        for _ in range(3):
            step()
        with _Count() as counter:
            step()
        enabled_cpu, disabled_cpu, per_step_pause, collections = [], [], [], []
        for _ in range(args.rounds):
            for enabled in (True, False):
                gc.enable() if enabled else gc.disable()
                gc.callbacks.append(on_gc)
                pauses.clear()
                t0 = time.process_time_ns()
                for _ in range(args.steps):
                    step()
                cpu = (time.process_time_ns() - t0) / args.steps
                gc.callbacks.remove(on_gc)
                if enabled:
                    enabled_cpu.append(cpu)
                    per_step_pause.append(sum(pauses) / args.steps)
                    collections.append(len(pauses) / args.steps)
                else:
                    disabled_cpu.append(cpu)
        gc.enable()
        full_ns, full_cpu_ns = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter_ns(), time.process_time_ns()
            gc.collect()
            full_ns.append(time.perf_counter_ns() - t0)
            full_cpu_ns.append(time.process_time_ns() - c0)
        objects = len(gc.get_objects())
        reset_global_memory_buffer()
    ops = counter.ops
    print(f"load {os.getloadavg()[0]:.2f}; {args.layers}-layer GPT, hidden 64, seq 32, fp32, 1 thread; "
          f"{ops} aten ops per step; {args.rounds} rounds x {args.steps} steps")
    print("round  cpu_us/step gc_on  cpu_us/step gc_off  gc_pause_us/step  collections/step")
    for i in range(args.rounds):
        print(f"{i:5d}  {enabled_cpu[i] / 1e3:18.0f}  {disabled_cpu[i] / 1e3:19.0f}  {per_step_pause[i] / 1e3:16.1f}"
              f"  {collections[i]:16.2f}")
    pause = statistics.median(per_step_pause)
    diff = statistics.median(a - b for a, b in zip(enabled_cpu, disabled_cpu))
    print(f"median gc pause per step {pause / 1e3:.1f} us = {pause / ops:.0f} ns per aten op "
          f"({100 * pause / statistics.median(enabled_cpu):.2f}% of the step's CPU time); "
          f"median CPU difference on-off {diff / 1e3:.1f} us per step = {diff / ops:.0f} ns per op")
    print(f"full gc.collect(), 3 in a row: wall {', '.join(f'{t / 1e3:.0f}' for t in full_ns)} us, CPU "
          f"{', '.join(f'{t / 1e3:.0f}' for t in full_cpu_ns)} us, over {objects} tracked objects")


if __name__ == "__main__":
    main()

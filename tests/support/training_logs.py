"""Training logs for the tests, written in the formats of Megatron-LM and NeMo (see
vtrain_plugin/measured/logs for the line formats), and Megatron-LM's TensorBoard scalars with a real
SummaryWriter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Logged:
    """What one Megatron-LM log line states."""

    iteration: int
    ms: float
    tflops: float = 150.0
    batch: int = 32
    skipped: int = 0
    nan: int = 0


def arguments_block(**values: object) -> list[str]:
    """Megatron-LM's ``_print_args``: the arguments sorted, dotted to column 48."""
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in sorted(values.items())]
    lines.append("-------------------- end of arguments ---------------------")
    return lines


def iteration_line(entry: Logged, *, train_iters: int = 1000) -> str:
    """One line of Megatron-LM's ``training_log``."""
    return (f" [2024-05-01 12:00:{entry.iteration % 60:02d}] iteration {entry.iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {entry.iteration * entry.batch:12d} |"
            f" elapsed time per iteration (ms): {entry.ms:.1f} |"
            f" throughput per GPU (TFLOP/s/GPU): {entry.tflops:.1f} |"
            f" learning rate: {1.5e-4:.6E} |"
            f" global batch size: {entry.batch:5d} |"
            f" lm loss: {7.123456:.6E} |"
            f" loss scale: {65536.0:.1f} |"
            f" grad norm: {1.234:.3f} |"
            f" number of skipped iterations: {entry.skipped:3d} |"
            f" number of nan iterations: {entry.nan:3d} |")


def memory_line(rank: int, iteration: int, max_allocated_mib: float, max_reserved_mib: float) -> str:
    """Megatron-LM's ``report_memory`` as a data-parallel rank 0 prints it."""
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {max_allocated_mib / 2} | "
            f"max allocated: {max_allocated_mib} | reserved: {max_reserved_mib} | max reserved: {max_reserved_mib}")


def megatron_log(entries: Sequence[Logged], *, world_size: int = 8, log_interval: int = 10,
                 memory: Sequence[tuple[int, float, float]] = ((0, 2048.5, 3072.0),),
                 resumed_at: int | None = None) -> list[str]:
    """The lines of one start of a Megatron-LM job: arguments, (checkpoint load,) iterations, memory
    reported after the first logged interval."""
    lines = ["using world size: %d, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel "
             "size: 2, pipeline-model-parallel size: 2" % world_size]
    lines += arguments_block(world_size=world_size, log_interval=log_interval, global_batch_size=entries[0].batch,
                             micro_batch_size=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    if resumed_at is not None:
        lines.append(f"  successfully loaded checkpoint from /checkpoints/small [ t 1/2, p 1/2 ] at iteration "
                     f"{resumed_at}")
    lines.append("[after training is done] datetime: 2024-05-01 12:00:00")
    for index, entry in enumerate(entries):
        lines.append(iteration_line(entry))
        if index == 0:
            lines += [memory_line(rank, entry.iteration, alloc, reserved) for rank, alloc, reserved in memory]
    return lines


def write_lines(path: Path, lines: Sequence[str], *, final_newline: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))
    return path


def nemo1_update(step: int, seconds: float, consumed: int) -> str:
    """One refresh of NeMo 1.x's tqdm progress bar (a carriage return before each)."""
    return (f"\rEpoch 0: :  {step // 10:2d}%|▏   | {step + 1}/1000 [00:40<32:40, reduced_train_loss=9.880, "
            f"global_step={step:.2f}, consumed_samples={consumed:.1f}, train_step_timing in s={seconds:.3f}]")


def nemo2_line(step: int, seconds: float, batch: int) -> str:
    """One line of NeMo 2.x's MegatronProgressBar."""
    return (f"Training epoch 0, iteration {step}/999 | lr: 1.5e-05 | global_batch_size: {batch} | global_step: "
            f"{step} | reduced_train_loss: 9.88 | train_step_timing in s: {seconds} | consumed_samples: "
            f"{(step + 1) * batch}")


def tensorboard_dir(path: Path, steps: Sequence[tuple[int, float]], *, world_size: int = 8, batch: int = 32,
                    max_allocated_bytes: float = 2.5 * 1024 ** 3, throughput: float = 150.0) -> Path:
    """One start of Megatron-LM's TensorBoard scalars (``iteration-time`` in seconds) in ``path``."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(path))
    for step, seconds in steps:
        writer.add_scalar("iteration-time", seconds, step)
        writer.add_scalar("throughput", throughput, step)
        writer.add_scalar("batch-size", batch, step)
        writer.add_scalar("world-size", world_size, step)
        writer.add_scalar("mem-max-allocated-bytes", max_allocated_bytes, step)
        writer.add_scalar("lm loss", 7.0, step)
    writer.close()
    return path

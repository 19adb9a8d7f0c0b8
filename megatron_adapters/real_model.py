"""Train the real megatron-core GPT of a ModelSpec on one device: the measured side of ``vtrain validate``.

The model is the one the tracer builds (same layer spec, same TransformerConfig, same loss), but
with real, initialized weights on a real device, on a fake process group of world size 1 (every
megatron-core parallel size is 1, so no collective runs). One iteration is what the estimate
assumes for TP = PP = DP = 1: ``num_microbatches`` forward/backward passes accumulating gradients,
then one optimizer step, both from megatron_adapters.training_step, the step the tracer records:
AdamW with Megatron's defaults (decoupled weight decay, gradient clipping by the global norm); for
fp16/bf16 models on fp32 main weights, as Megatron's mixed-precision optimizer keeps them (fp16
with a static loss scale of 4096, unscaled with the inf check, the step skipped on an inf).

Peak memory. CUDA: ``torch.cuda.max_memory_allocated`` over model, optimizer and training (the
tensors the caching allocator handed out). CPU: the process's peak resident set (``VmHWM`` of
/proc/self/status, reset through /proc/self/clear_refs just before the model is built) minus the
resident set at that moment, so the Python interpreter and libraries are not counted but the
allocator's slack is; where the reset is not permitted the peak since process start is used.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_adapters.conventions import ChunkRole
from megatron_adapters.gpt import build_chunk
from megatron_adapters.training_step import AdamSettings, MicroBatch, MixedPrecisionAdamW, forward_backward
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import GIB
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.training import model_state_bytes_per_parameter
_INIT_STD = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingMeasurement:
    iteration_ms: tuple[float, ...]  # each timed iteration, after the warm-up ones
    warmup_iterations: int
    num_microbatches: int
    peak_memory_bytes: int
    final_loss: float
    device: str

    @property
    def median_ms(self) -> float:
        return statistics.median(self.iteration_ms)


def required_memory_bytes(model: ModelSpec, plan: ParallelPlan) -> int:
    """Rough memory one device needs to train ``model`` unsharded (the refusal check, not a prediction).

    Model states by specs.training.model_state_bytes_per_parameter, the memory model's: weight and
    gradient in the model dtype (the real step accumulates each weight's ``.grad`` in it, see
    :mod:`megatron_adapters.training_step`), an fp32 main weight when the model dtype is narrower
    and two fp32 Adam moments, 2 + 2 + 4 + 8 = 16 bytes per parameter in fp16 and bf16 and
    4 + 4 + 8 = 16 in fp32 (the optimizer step's transient fp32 main gradients are not counted);
    activations of one micro-batch
    per layer after Korthikanti et al. (``34 s b h + 5 a s^2 b`` bytes at 2-byte activations, scaled
    to the dtype; selective recompute keeps ``34 s b h`` of them, full recompute only the layer's
    ``2 s b h`` input, and both rebuild one whole layer in the backward pass); the fp32 logits with
    their softmax and gradient (``3 * 4 s b V``).
    """
    per_param = model_state_bytes_per_parameter(model.dtype, gradients=model.dtype)
    s, b, h, a = model.seq_length, plan.micro_batch_size, model.hidden_size, model.num_attention_heads
    scale = model.dtype.nbytes / 2
    whole_layer = 34 * s * b * h + 5 * a * s * s * b
    kept_per_layer = {Recompute.NONE: whole_layer, Recompute.SELECTIVE: 34 * s * b * h,
                      Recompute.FULL: 2 * s * b * h}[plan.recompute]
    rebuilt = 0 if plan.recompute is Recompute.NONE else whole_layer
    activations = (model.num_layers * kept_per_layer + rebuilt) * scale
    logits = 3 * 4 * s * b * model.padded_vocab_size(1)
    return int(model.num_parameters * per_param + activations + logits)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: ``MemAvailable`` of /proc/meminfo on CPU, the CUDA free memory on GPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo to check that the model fits")


def check_fits(model: ModelSpec, plan: ParallelPlan, device: torch.device) -> None:
    need, have = required_memory_bytes(model, plan), available_memory_bytes(device)
    if need > have:
        raise ConfigError(
            f"model {model.name or model.family.value} ({model.num_parameters / 1e6:,.0f}M parameters, "
            f"micro_batch_size {plan.micro_batch_size}, seq_length {model.seq_length}) needs about "
            f"{need / GIB:.1f} GiB to train on one device, more than the {have / GIB:.1f} GiB free on {device}; "
            f"validate a smaller model (fewer layers or a smaller micro-batch)")


def train(model: ModelSpec, plan: ParallelPlan, *, num_microbatches: int, iterations: int, warmup: int,
          device: str = "cpu", seed: int = 0, adam: AdamSettings = AdamSettings()) -> TrainingMeasurement:
    """Build the real model of ``model`` on ``device`` and time ``warmup + iterations`` training iterations."""
    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer

    if plan.world_size != 1:
        raise ConfigError(f"real training runs on one device; parallel world size is {plan.world_size}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ConfigError("validate trains on a fake process group of its own and cannot while this process's "
                          "torch.distributed is initialized: run `vtrain validate` apart from the training script "
                          "(inside it, time the script's own iterations with vtrain.IterationRecorder)")
    if model.is_moe:
        raise ConfigError(f"model.num_experts ({model.num_experts}): real training of MoE models is not supported: "
                          f"the traced MoE layer routes by an assumption, and its step on real tensors ran 15x "
                          f"slower than its own kernels on an H100 (benchmarks/results/2026-11-26_h100_today_layers.md)")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but torch.cuda.is_available() is False")
    check_fits(model, plan, dev)
    with quiet_megatron(), _device_patches(dev), fake_world(plan):
        reset_global_memory_buffer()
        memory = PeakMemory(dev)
        gpt = build_chunk(model, plan, ChunkRole(pipeline_rank=0, chunk=0, pre_process=True, post_process=True),
                          layers_per_chunk=model.num_layers)
        _initialize(gpt, seed)
        gpt.to(dev)
        gpt.train()
        optimizer = MixedPrecisionAdamW(gpt.parameters(), adam)
        generator = torch.Generator(device=dev).manual_seed(seed)
        sync = torch.cuda.synchronize if dev.type == "cuda" else _no_sync
        times_ms: list[float] = []
        loss = math.nan
        for i in range(warmup + iterations):
            batches = [random_micro_batch(plan.micro_batch_size, model.seq_length, model.vocab_size, dev, generator)
                       for _ in range(num_microbatches)]
            sync()
            start_ns = time.perf_counter_ns()
            for batch in batches:
                loss = forward_backward(gpt, batch, num_microbatches=num_microbatches,
                                        loss_scale=optimizer.loss_scale)
            optimizer.step()
            sync()
            if i >= warmup:
                times_ms.append((time.perf_counter_ns() - start_ns) / 1e6)
        peak = memory.peak_bytes()
        reset_global_memory_buffer()
    return TrainingMeasurement(iteration_ms=tuple(times_ms), warmup_iterations=warmup,
                               num_microbatches=num_microbatches, peak_memory_bytes=peak,
                               final_loss=float(loss.detach()), device=str(dev))


def _no_sync() -> None:
    return None


def random_micro_batch(micro_batch_size: int, seq_length: int, vocab_size: int, dev: torch.device,
                       generator: torch.Generator) -> MicroBatch:
    """Random tokens and labels, causal mask (True = masked, megatron's convention), as the tracer's shapes."""
    b, s = micro_batch_size, seq_length
    tokens = torch.randint(0, vocab_size, (b, s), device=dev, generator=generator)
    labels = torch.randint(0, vocab_size, (b, s), device=dev, generator=generator)
    return MicroBatch(tokens=tokens,
                      position_ids=torch.arange(s, device=dev).unsqueeze(0).expand(b, s),
                      attention_mask=torch.ones(s, s, dtype=torch.bool, device=dev).triu(1).view(1, 1, s, s),
                      labels=labels, loss_mask=torch.ones(b, s, dtype=torch.float32, device=dev))


def _initialize(gpt: torch.nn.Module, seed: int) -> None:
    """GPT-2 style: weights normal(0, 0.02), biases 0, norm scales 1 (the built model is uninitialized)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * _INIT_STD)


class PeakMemory:
    """The peak memory of ``dev`` from construction on: the CUDA caching allocator's tensors, or on
    the CPU the growth of the process's peak resident set (VmHWM, reset here)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.base = 0
        else:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _status_bytes("VmRSS")

    def peak_bytes(self) -> int:
        if self.dev.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.dev))
        return max(0, _status_bytes("VmHWM") - self.base)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise ConfigError(f"cannot read {field} from /proc/self/status to measure peak memory")


@contextlib.contextmanager
def _device_patches(dev: torch.device) -> Iterator[None]:
    """On CPU, megatron-core's CUDA calls need the stand-ins the tracer uses; on CUDA, only the
    names megatron-core 0.16 leaves unusable when TransformerEngine is not installed."""
    if dev.type == "cpu":
        from megatron_adapters.cpu_patches import cpu_tracing_patches

        with cpu_tracing_patches():
            yield
        return
    import importlib.util

    from megatron_adapters.cpu_patches import patched
    from megatron_adapters.stand_ins import no_transformer_engine_patches

    patches = no_transformer_engine_patches() if importlib.util.find_spec("transformer_engine") is None else []
    with torch.cuda.device(dev), patched(patches):
        yield

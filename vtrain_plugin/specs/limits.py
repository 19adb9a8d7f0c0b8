"""Input limits: the largest (and smallest) values vtrain accepts, each with the reason for it.

The specs check their fields against these bounds on construction, so the Python API and the CLI
refuse the same inputs, and a run is refused before anything is traced. The bounds are generous
(ten times or more beyond the largest runs known) and exist for three reasons: an estimate must
finish in seconds (the simulated schedule grows with micro-batches times pipeline stages), every
number it prints must be finite, and the traced tensors must stay within 64-bit sizes. Every
number must also be finite: an infinity is above any maximum, and a NaN is in no range.
README, "Input limits", has the table of :func:`limits_table`; a test keeps the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """One bound: ``quantity`` as the README names it, the inputs it applies to, the accepted range
    (inclusive) and why."""

    quantity: str
    inputs: str  # the fields and keys checked against it, as the user writes them
    maximum: int | float
    minimum: int | float | None = None  # None: only the field's own rule (positive, non-negative)
    reason: str

    @property
    def rule(self) -> str:
        if self.minimum is None:
            return f"must be at most {_number(self.maximum)}"
        return f"must lie in [{_number(self.minimum)}, {_number(self.maximum)}]"

    def check(self, name: str, value: int | float) -> Any:
        """``value`` if within the bounds (a NaN never is), else a ConfigError naming ``name``."""
        low = -math.inf if self.minimum is None else self.minimum
        if not low <= value <= self.maximum:
            raise ConfigError(f"{name} {self.rule}, got {v.show(value)}")
        return value

    def check_derived(self, expression: str, value: int) -> None:
        """A bound on a value computed from several fields; ``expression`` shows the arithmetic."""
        if value > self.maximum:
            raise ConfigError(f"{expression} = {v.show(value)} {self.rule} ({self.quantity})")

    def positive_int(self, name: str, value: Any) -> int:
        """A positive integer within the bounds."""
        return self.check(name, v.positive_int(name, value))

    def positive_number(self, name: str, value: Any) -> float:
        """A positive, finite number within the bounds."""
        v.positive_number(name, value)
        return v.as_float(self.check(name, value))

    def non_negative_number(self, name: str, value: Any) -> float:
        """A non-negative, finite number within the bounds."""
        v.non_negative_number(name, value)
        return v.as_float(self.check(name, value))


def _number(x: int | float) -> str:
    """``1,048,576``, ``0.001``, ``1e+15``: thousands separated, small and huge floats in short form."""
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.0f}" if x.is_integer() and x < 1e9 else f"{x:g}"


WORLD_SIZE = Limit(
    quantity="GPUs", maximum=1_048_576,
    inputs="parallel.tensor_parallel, pipeline_parallel, data_parallel and their product; vTrain num_gpus, "
           "*_parallel_size; search --gpus",
    reason="about ten times the largest GPU clusters built (some 100,000 GPUs)")
GPUS_PER_NODE = Limit(
    quantity="GPUs per node", maximum=4_096, inputs="cluster.gpus_per_node; vTrain node_size",
    reason="the largest NVLink domains hold 72 to 576 GPUs")
NUM_LAYERS = Limit(
    quantity="layers", maximum=10_000, inputs="model.num_layers, parallel.virtual_pipeline; vTrain num_layers",
    reason="the largest models have about 100 to 200 layers; a model chunk holds at least one")
HIDDEN_SIZE = Limit(
    quantity="hidden size", maximum=262_144, inputs="model.hidden_size; vTrain hidden_size",
    reason="ten times the largest models' (some 25,000)")
FFN_HIDDEN_SIZE = Limit(
    quantity="FFN hidden size", maximum=1_048_576, inputs="model.ffn_hidden_size",
    reason="four times the largest hidden size")
ATTENTION_HEADS = Limit(
    quantity="attention heads", maximum=4_096,
    inputs="model.num_attention_heads (num_query_groups divide them); vTrain num_attention_heads",
    reason="the largest models have 128 to 160; with the tokens per micro-batch, bounds the attention scores")
VOCAB_SIZE = Limit(
    quantity="vocabulary", maximum=4_194_304, inputs="model.vocab_size; vTrain vocab_size",
    reason="the largest vocabularies have about 256,000 tokens")
SEQ_LENGTH = Limit(
    quantity="sequence length", maximum=1_048_576, inputs="model.seq_length; vTrain max_length",
    reason="one-million-token contexts are the longest trained")
MICRO_BATCH_SIZE = Limit(
    quantity="micro-batch size", maximum=65_536, inputs="parallel.micro_batch_size; vTrain micro_batch_size",
    reason="real micro-batches hold 1 to a few dozen sequences")
MICRO_BATCH_TOKENS = Limit(
    quantity="tokens per micro-batch", maximum=16_777_216, inputs="micro-batch size x sequence length",
    reason="the largest traced tensor, the unfused attention scores (micro-batch x heads x sequence^2), "
           "stays below 2^56 elements, so byte sizes and FLOPs fit 64 bits")
GLOBAL_BATCH_SIZE = Limit(
    quantity="global batch", maximum=16_777_216,
    inputs="training.global_batch_size; vTrain global_batch_size; search --global-batch",
    reason="sequences per iteration; the largest runs use a few thousand")
MICRO_BATCHES = Limit(
    quantity="micro-batches per iteration", maximum=250_000,
    inputs="global batch / (data parallel x micro-batch size)",
    reason="real iterations accumulate at most some thousands; see scheduled passes")
SCHEDULED_PASSES = Limit(
    quantity="scheduled passes", maximum=250_000,
    inputs="micro-batches x pipeline stages x model chunks per stage",
    reason="the simulated schedule holds a forward and a backward task per pass: at the limit an estimate "
           "takes some 5 s and half a gigabyte")
TOTAL_TOKENS = Limit(
    quantity="tokens of the whole run", maximum=1e15, inputs="training.total_tokens; --tokens",
    reason="about thirty times the largest runs (some 30 trillion tokens)")
BUCKET_SIZE_MB = Limit(
    quantity="gradient bucket (MB)", maximum=1e6, inputs="training.bucket_size_mb; vTrain ddp_bucket_size",
    reason="a terabyte: more than any model's gradients on one GPU")
INTRA_NODE_BANDWIDTH = Limit(
    quantity="intra-node bandwidth (GB/s per GPU)", minimum=1e-3, maximum=1e6,
    inputs="cluster.intra_node_bandwidth_gbytes_per_s; vTrain intra_node_bandwidth",
    reason="from 1 MB/s to a thousand times NVLink's 900 GB/s; transfer times stay finite")
INTER_NODE_BANDWIDTH = Limit(
    quantity="inter-node bandwidth (Gbit/s per node)", minimum=1e-3, maximum=1e7,
    inputs="cluster.inter_node_bandwidth_gbps; vTrain inter_node_bandwidth",
    reason="from 1 Mbit/s to a thousand times today's 8 x 400 Gbit/s")
LATENCY_US = Limit(
    quantity="link latency (us)", maximum=1e6, inputs="cluster.intra_node_latency_us, inter_node_latency_us",
    reason="one second; real links take 1 to 10 us")
NETWORK_EFFICIENCY = Limit(
    quantity="network efficiency", minimum=0.01, maximum=1.0, inputs="cluster.network_efficiency",
    reason="a fraction of the nominal bandwidth; NCCL reaches 50 to 95%")
HOST_MEMORY_BANDWIDTH = Limit(
    quantity="host memory bandwidth (GB/s per node)", minimum=1.0, maximum=1e5,
    inputs="cluster.host_memory_bandwidth_gbytes_per_s",
    reason="from 1 GB/s to a hundred times a two-socket server's 600 GB/s")
PRICE_PER_GPU_HOUR = Limit(
    quantity="price (USD per GPU-hour)", maximum=10_000.0, inputs="cluster.price_per_gpu_hour_usd",
    reason="cloud GPUs cost 1 to 10 USD an hour; every cost printed stays finite")
FAILURE_RATE = Limit(
    quantity="failures per GPU-hour", maximum=0.01, inputs="reliability.failure_rate_per_gpu_hour",
    reason="Llama 3 saw 2e-5 (one interruption every 3 hours on 16,384 GPUs); 0.01 stops a 1,000-GPU job "
           "every 6 minutes")
RESTART_MINUTES = Limit(
    quantity="restart (minutes)", maximum=10_080.0, inputs="reliability.restart_minutes",
    reason="a week; real restarts take minutes to an hour")
STORAGE_BANDWIDTH = Limit(
    quantity="storage bandwidth (GB/s)", minimum=1e-3, maximum=1e6,
    inputs="reliability.storage_{write,read}_gbytes_per_s_{per_node,total}",
    reason="from 1 MB/s to 500 times Llama 3's 2 TB/s file system; checkpoint times stay finite")
CHECKPOINT_INTERVAL = Limit(
    quantity="checkpoint interval (iterations)", maximum=100_000_000,
    inputs="reliability.checkpoint_interval_iterations; --checkpoint-interval",
    reason="runs take some 10^5 to 10^6 iterations; an interval longer than the run is clamped to it")
FILE_BYTES = Limit(
    quantity="plan file size (bytes)", maximum=65_536, inputs="plan files and vTrain configs",
    reason="plan files take a few hundred bytes; parsing stays well under a second")
NESTING_DEPTH = Limit(
    quantity="plan file nesting (levels)", maximum=32, inputs="plan files and vTrain configs",
    reason="plan files nest two levels; parsers recurse once per level")
FILE_VALUES = Limit(
    quantity="plan file values", maximum=10_000, inputs="plan files and vTrain configs, YAML aliases expanded",
    reason="plan files hold some 50 values; a YAML alias bomb expands to billions")

LIMITS: tuple[Limit, ...] = (
    WORLD_SIZE, GPUS_PER_NODE, NUM_LAYERS, HIDDEN_SIZE, FFN_HIDDEN_SIZE, ATTENTION_HEADS, VOCAB_SIZE, SEQ_LENGTH,
    MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS, GLOBAL_BATCH_SIZE, MICRO_BATCHES, SCHEDULED_PASSES, TOTAL_TOKENS,
    BUCKET_SIZE_MB, INTRA_NODE_BANDWIDTH, INTER_NODE_BANDWIDTH, LATENCY_US, NETWORK_EFFICIENCY, HOST_MEMORY_BANDWIDTH, PRICE_PER_GPU_HOUR,
    FAILURE_RATE, RESTART_MINUTES, STORAGE_BANDWIDTH, CHECKPOINT_INTERVAL, FILE_BYTES, NESTING_DEPTH, FILE_VALUES,
)


def limits_table() -> str:
    """The Markdown table of :data:`LIMITS` that README, "Input limits", holds."""
    rows = ["| quantity | inputs | accepted | why |", "|---|---|---|---|"]
    for limit in LIMITS:
        accepted = (f"at most {_number(limit.maximum)}" if limit.minimum is None
                    else f"{_number(limit.minimum)} to {_number(limit.maximum)}")
        rows.append(f"| {limit.quantity} | {limit.inputs} | {accepted} | {limit.reason} |")
    return "\n".join(rows) + "\n"

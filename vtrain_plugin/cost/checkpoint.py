"""What a checkpoint holds and how long writing and loading it take.

Bytes are those of Megatron-Core's distributed checkpoint (``dist_checkpointing``), each sharded
tensor once whatever its replicas: the model's weights in the model dtype, at their global shapes
(the word embeddings padded to a multiple of 128 x TP rows, as Megatron pads them; a tied output
layer is the embedding and is saved once), and the optimizer's state in megatron-core's default
``fully_sharded_model_space`` format, which stores per parameter its fp32 main weight (mixed
precision only) and Adam's two fp32 moments: 12 bytes per parameter in bf16/fp16, 8 in fp32. The
distributed optimizer changes who writes, not what. Not counted: the few kilobytes of common state
(arguments, RNG states, the iteration) and Megatron-LM's ``dp_reshardable`` format's bucket padding.

Megatron-Core saves fully in parallel: every GPU writes 1/N of the checkpoint, so a write is bound
by each node's link to the storage and by the file system's total bandwidth, whichever is
narrower; a load likewise at the read bandwidths. An asynchronous save stops training only to copy
each GPU's 1/N to host memory over the GPU's host link.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import OpGraph
from vtrain_plugin.core.units import GBYTE
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.reliability import CheckpointMode, ReliabilitySpec
from vtrain_plugin.specs.training import optimizer_bytes_per_parameter


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSize:
    parameters: int  # unique parameters of the whole model, as saved
    model_nbytes: int  # weights in the model dtype
    optimizer_nbytes: int  # fp32 main weights (mixed precision) and Adam's two moments

    @property
    def total_nbytes(self) -> int:
        return self.model_nbytes + self.optimizer_nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointTimes:
    write_s: float  # the whole checkpoint to storage
    load_s: float  # the whole checkpoint from storage, at a restart
    host_copy_s: float  # each GPU's share to host memory (what an asynchronous save stalls for)

    def stall_s(self, mode: CheckpointMode) -> float:
        """Training stopped per checkpoint, the next save not yet waiting for this one."""
        return self.write_s if mode is CheckpointMode.SYNC else self.host_copy_s

    def stall_at_interval_s(self, mode: CheckpointMode, interval_s: float) -> float:
        """Training stopped per checkpoint at ``interval_s`` of compute between checkpoints: an
        asynchronous save also waits for the previous save's write when the interval is shorter."""
        return self.stall_s(mode) + (0.0 if mode is CheckpointMode.SYNC else max(0.0, self.write_s - interval_s))

    def shortest_interval_s(self, mode: CheckpointMode) -> float:
        """The shortest interval worth choosing: asynchronous, the write, since a shorter interval
        only waits for it (the segment grows by the wait as the compute in it shrinks)."""
        return self.write_s if mode is CheckpointMode.ASYNC else 0.0


def checkpoint_size(graph: OpGraph) -> CheckpointSize:
    """Of ``graph``'s model, or for a plain module of the traced stages' parameters."""
    if graph.model is not None:
        return model_checkpoint_size(graph.model, tensor_parallel=graph.parallel.tensor_parallel)
    return _size(sum(stage.num_parameters for stage in graph.stages), graph.dtype)


def model_checkpoint_size(model: ModelSpec, *, tensor_parallel: int) -> CheckpointSize:
    """The model's parameters with Megatron's vocabulary padding at ``tensor_parallel``."""
    padding = model.padded_vocab_size(tensor_parallel) - model.vocab_size
    return _size(model.num_parameters + padding * model.hidden_size * (1 if model.tied else 2), model.dtype)


def _size(params: int, dtype: Dtype) -> CheckpointSize:
    return CheckpointSize(parameters=params, model_nbytes=params * dtype.nbytes,
                          optimizer_nbytes=params * optimizer_bytes_per_parameter(dtype))


def checkpoint_times(size: CheckpointSize, reliability: ReliabilitySpec, *, num_gpus: int, gpus_per_node: int,
                     host_link_gbytes_per_s: float) -> CheckpointTimes:
    """Write, load and host-copy times of ``size`` on ``num_gpus`` GPUs (see the module doc)."""
    nodes = -(-num_gpus // gpus_per_node)
    write = min(nodes * reliability.storage_write_gbytes_per_s_per_node, reliability.storage_write_gbytes_per_s_total)
    read = min(nodes * reliability.storage_read_gbytes_per_s_per_node, reliability.storage_read_gbytes_per_s_total)
    nbytes = size.total_nbytes
    return CheckpointTimes(write_s=nbytes / (write * GBYTE), load_s=nbytes / (read * GBYTE),
                           host_copy_s=nbytes / num_gpus / (host_link_gbytes_per_s * GBYTE))

"""What the pipeline simulation consumes: per-chunk durations, already summed from the op graph.

Everything here is per micro-batch of one representative rank (TP and DP replicas are symmetric),
so a simulation costs O(pipeline stages x virtual stages x micro-batches) whatever the GPU count.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.training import ScheduleKind


@dataclass(frozen=True, slots=True, kw_only=True)
class DpBucket:
    """One gradient bucket's data-parallel reduction (all-reduce, or reduce-scatter)."""

    comm_ns: float
    ready_fraction: float  # 0..1: ready this far into the chunk's last backward (1: at its end)

    def __post_init__(self) -> None:
        v.non_negative_number("dp_bucket.comm_ns", self.comm_ns)
        if not 0.0 <= self.ready_fraction <= 1.0:
            raise ConfigError(f"dp_bucket.ready_fraction must be in [0, 1], got {self.ready_fraction!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamGather:
    """One bucket's parameter all-gather of the distributed optimizer."""

    comm_ns: float
    need_fraction: float  # 0..1: needed this far into the chunk's first forward (0: at its start)

    def __post_init__(self) -> None:
        v.non_negative_number("param_gather.comm_ns", self.comm_ns)
        if not 0.0 <= self.need_fraction <= 1.0:
            raise ConfigError(f"param_gather.need_fraction must be in [0, 1], got {self.need_fraction!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkWork:
    """One model chunk (virtual pipeline stage) on its representative rank, per micro-batch."""

    forward_ns: float  # forward compute including blocking TP collectives
    backward_ns: float  # backward compute including blocking TP collectives, recompute excluded
    recompute_ns: float = 0.0  # activation recompute, run right before this chunk's backward
    tp_comm_forward_ns: float = 0.0  # share of forward_ns spent in TP collectives
    tp_comm_backward_ns: float = 0.0  # share of backward_ns + recompute_ns spent in TP collectives
    cp_comm_forward_ns: float = 0.0  # share of forward_ns spent in exposed CP attention communication
    cp_comm_backward_ns: float = 0.0  # share of backward_ns + recompute_ns spent in exposed CP communication
    # Shares spent in the MoE layers' dispatch and combine collectives (EP, expert TP): blocking like
    # TP collectives, reported apart.
    ep_comm_forward_ns: float = 0.0
    ep_comm_backward_ns: float = 0.0
    # Shares spent waiting for FSDP's per-unit all-gathers and reduce-scatters (cost.comm.fsdp),
    # reported as DP communication.
    dp_comm_forward_ns: float = 0.0
    dp_comm_backward_ns: float = 0.0
    p2p_forward_ns: float = 0.0  # send of the output activation to the next virtual stage
    p2p_backward_ns: float = 0.0  # send of the input gradient to the previous virtual stage
    dp_buckets: tuple[DpBucket, ...] = ()
    param_gathers: tuple[ParamGather, ...] = ()  # distributed optimizer, in the order forward needs them

    def __post_init__(self) -> None:
        for name in ("forward_ns", "backward_ns", "recompute_ns", "tp_comm_forward_ns",
                     "tp_comm_backward_ns", "cp_comm_forward_ns", "cp_comm_backward_ns", "ep_comm_forward_ns",
                     "ep_comm_backward_ns", "dp_comm_forward_ns", "dp_comm_backward_ns", "p2p_forward_ns",
                     "p2p_backward_ns"):
            v.non_negative_number(f"chunk_work.{name}", getattr(self, name))
        if self.tp_comm_forward_ns > self.forward_ns:
            raise ConfigError(f"chunk_work.tp_comm_forward_ns ({self.tp_comm_forward_ns}) must not "
                              f"exceed forward_ns ({self.forward_ns})")
        if self.tp_comm_backward_ns > self.backward_ns + self.recompute_ns:
            raise ConfigError(f"chunk_work.tp_comm_backward_ns ({self.tp_comm_backward_ns}) must not "
                              f"exceed backward_ns + recompute_ns ({self.backward_ns + self.recompute_ns})")
        comm_forward = (self.tp_comm_forward_ns + self.cp_comm_forward_ns + self.ep_comm_forward_ns
                        + self.dp_comm_forward_ns)
        if comm_forward > self.forward_ns:
            raise ConfigError(f"chunk_work.tp_comm_forward_ns + cp_comm_forward_ns + ep_comm_forward_ns + "
                              f"dp_comm_forward_ns ({self.tp_comm_forward_ns} + {self.cp_comm_forward_ns} + "
                              f"{self.ep_comm_forward_ns} + {self.dp_comm_forward_ns} = {comm_forward}) must not "
                              f"exceed forward_ns ({self.forward_ns})")
        comm_backward = (self.tp_comm_backward_ns + self.cp_comm_backward_ns + self.ep_comm_backward_ns
                         + self.dp_comm_backward_ns)
        if comm_backward > self.backward_ns + self.recompute_ns:
            raise ConfigError(f"chunk_work.tp_comm_backward_ns + cp_comm_backward_ns + ep_comm_backward_ns + "
                              f"dp_comm_backward_ns ({self.tp_comm_backward_ns} + {self.cp_comm_backward_ns} + "
                              f"{self.ep_comm_backward_ns} + {self.dp_comm_backward_ns} = {comm_backward}) must not "
                              f"exceed backward_ns + recompute_ns ({self.backward_ns + self.recompute_ns})")
        object.__setattr__(self, "dp_buckets", tuple(self.dp_buckets))
        object.__setattr__(self, "param_gathers", tuple(self.param_gathers))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineWork:
    """One iteration's work: chunks indexed by virtual stage ``chunk * pp + pipeline_rank``."""

    chunks: tuple[ChunkWork, ...]
    pipeline_parallel: int
    virtual_pipeline: int = 1
    num_microbatches: int
    schedule: ScheduleKind
    microbatch_group_size: int | None = None  # interleaved schedule's micro-batch groups; None: pp
    # False: every DP bucket after the rank's last backward (Megatron-DeepSpeed without buckets).
    # True: a bucket is launched when ready during its chunk's last backward (Megatron DDP
    # overlap_grad_reduce); one DP stream per rank, first ready first served.
    dp_overlap: bool
    # Distributed optimizer's parameter all-gathers: False, after the optimizer step; True
    # (overlap_param_gather), issued at the start of the iteration and awaited by each chunk's
    # first forward, bucket by bucket.
    param_gather_overlap: bool = False
    embedding_sync_ns: float = 0.0  # tied-embedding grad all-reduce, first and last rank, after DP
    optimizer_ns: tuple[float, ...]  # per pipeline rank

    def __post_init__(self) -> None:
        v.positive_int("pipeline_work.pipeline_parallel", self.pipeline_parallel)
        v.positive_int("pipeline_work.virtual_pipeline", self.virtual_pipeline)
        v.positive_int("pipeline_work.num_microbatches", self.num_microbatches)
        object.__setattr__(self, "schedule", ScheduleKind(v.one_of(
            "pipeline_work.schedule", str(self.schedule), [k.value for k in ScheduleKind])))
        v.boolean("pipeline_work.dp_overlap", self.dp_overlap)
        v.boolean("pipeline_work.param_gather_overlap", self.param_gather_overlap)
        v.non_negative_number("pipeline_work.embedding_sync_ns", self.embedding_sync_ns)
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "optimizer_ns", tuple(self.optimizer_ns))
        stages = self.pipeline_parallel * self.virtual_pipeline
        if len(self.chunks) != stages:
            raise ConfigError(
                f"pipeline_work.chunks has {len(self.chunks)} entries; pipeline_parallel "
                f"({self.pipeline_parallel}) * virtual_pipeline ({self.virtual_pipeline}) = {stages} needed")
        if len(self.optimizer_ns) != self.pipeline_parallel:
            raise ConfigError(
                f"pipeline_work.optimizer_ns has {len(self.optimizer_ns)} entries; one per pipeline rank "
                f"({self.pipeline_parallel}) needed")
        for r, t in enumerate(self.optimizer_ns):
            v.non_negative_number(f"pipeline_work.optimizer_ns[{r}]", t)

    @property
    def num_virtual_stages(self) -> int:
        return self.pipeline_parallel * self.virtual_pipeline

    def chunk(self, pipeline_rank: int, model_chunk: int) -> ChunkWork:
        return self.chunks[model_chunk * self.pipeline_parallel + pipeline_rank]

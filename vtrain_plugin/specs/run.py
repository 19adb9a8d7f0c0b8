"""One run: application (model), execution (parallel plan and training) and system (cluster)."""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec, check_schedule


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """The four specs of one run, validated together (the plan must shard the model, the batch
    must split into micro-batches, the schedule must suit the plan), so that a run that cannot be
    estimated is refused before it is traced; ``source`` names the file it came from, if any."""

    model: ModelSpec
    parallel: ParallelPlan
    training: TrainingSpec
    cluster: ClusterSpec
    source: str = ""

    def __post_init__(self) -> None:
        self.parallel.check_fits(self.model)
        self.training.check_model(self.model)
        self.training.check_plan(self.parallel)
        check_schedule(self.training.schedule, self.parallel.pipeline_parallel, self.parallel.virtual_pipeline,
                       self.num_microbatches, self.training.microbatch_group_size)

    @property
    def num_microbatches(self) -> int:
        return self.training.num_microbatches(self.parallel.data_parallel, self.parallel.micro_batch_size)

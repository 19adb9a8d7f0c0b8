"""What the user describes: model, parallel plan, training, cluster, and the readers of their files."""

from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.parallel import CpCommType, ParallelPlan, Recompute
from vtrain_plugin.specs.plan_file import PlanSections, parse_plan
from vtrain_plugin.specs.reading import read_mapping
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import GradReduce, ScheduleKind, SoftwareStack, TrainingSpec

__all__ = ["ClusterSpec", "CpCommType", "Family", "GradReduce", "ModelSpec", "ParallelPlan", "PlanSections", "Recompute",
           "RunConfig", "ScheduleKind", "SoftwareStack", "TrainingSpec", "parse_plan", "read_mapping"]

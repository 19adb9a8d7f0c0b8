"""Pipeline simulation: work per chunk, schedules, the event engine and the timeline export."""

from vtrain_plugin.sim.engine import RankBreakdown, SimResult, simulate
from vtrain_plugin.sim.schedules import (Schedule, Task, TaskKind, build_schedule, register_schedule,
                                         schedule_builder)
from vtrain_plugin.sim.timeline import (Interval, IntervalKind, Stream, Timeline, to_chrome_trace,
                                        write_chrome_trace)
from vtrain_plugin.sim.work import ChunkWork, DpBucket, PipelineWork, ScheduleKind

__all__ = ["ChunkWork", "DpBucket", "Interval", "IntervalKind", "PipelineWork", "RankBreakdown", "Schedule",
           "ScheduleKind", "SimResult", "Stream", "Task", "TaskKind", "Timeline", "build_schedule",
           "register_schedule", "schedule_builder", "simulate", "to_chrome_trace", "write_chrome_trace"]

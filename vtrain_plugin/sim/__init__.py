"""Pipeline simulation: schedules, the event engine and the timeline export."""

from vtrain_plugin.sim.engine import RankBreakdown, SimResult, simulate
from vtrain_plugin.sim.schedules import (Occupancy, Schedule, Task, TaskKind, build_schedule, register_schedule,
                                         schedule_builder, schedule_occupancy)
from vtrain_plugin.sim.timeline import (Interval, IntervalKind, Stream, Timeline, to_chrome_trace,
                                        write_chrome_trace)

__all__ = ["Interval", "IntervalKind", "Occupancy", "RankBreakdown", "Schedule", "SimResult", "Stream", "Task",
           "TaskKind", "Timeline", "build_schedule", "register_schedule", "schedule_builder", "schedule_occupancy",
           "simulate", "to_chrome_trace", "write_chrome_trace"]

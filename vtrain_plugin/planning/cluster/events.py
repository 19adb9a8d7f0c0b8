"""The event loop of the cluster simulation, in the style of Microsoft's vidur simulator: an event
knows its time and how to handle itself, and handling it returns the events it causes.

Four kinds: a job arrives, a job finishes, a job fails (with failures on), the scheduler runs. At
one instant, finishes come first, then failures, then arrivals, then one scheduling pass that sees
them all (:class:`EventKind`); a finish or a failure carries the epoch of the allocation it was
drawn for, so a resize makes the old one stale.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Protocol


class EventKind(IntEnum):
    """The order of events at the same instant."""

    FINISH = 0
    FAILURE = 1
    ARRIVAL = 2
    SCHEDULE = 3


class EventTarget(Protocol):
    """What events act on (:class:`~vtrain_plugin.planning.cluster.simulator.Simulation`)."""

    def arrive(self, job: int, time_s: float) -> list[Event]: ...

    def finish(self, job: int, epoch: int, time_s: float) -> list[Event]: ...

    def fail(self, job: int, epoch: int, time_s: float) -> list[Event]: ...

    def schedule(self, time_s: float) -> list[Event]: ...


@dataclass(frozen=True, slots=True)
class Event(ABC):
    time_s: float
    kind: ClassVar[EventKind]

    @abstractmethod
    def handle(self, target: EventTarget) -> list[Event]:
        """Apply the event; return the events it causes."""


@dataclass(frozen=True, slots=True)
class Arrival(Event):
    job: int
    kind: ClassVar[EventKind] = EventKind.ARRIVAL

    def handle(self, target: EventTarget) -> list[Event]:
        return target.arrive(self.job, self.time_s)


@dataclass(frozen=True, slots=True)
class AllocationEvent(Event):
    """An event of one allocation of a job: stale once the job's allocation has changed."""

    job: int
    epoch: int  # the allocation it was predicted (a finish) or drawn (a failure) for


@dataclass(frozen=True, slots=True)
class Finish(AllocationEvent):
    kind: ClassVar[EventKind] = EventKind.FINISH

    def handle(self, target: EventTarget) -> list[Event]:
        return target.finish(self.job, self.epoch, self.time_s)


@dataclass(frozen=True, slots=True)
class Failure(AllocationEvent):
    kind: ClassVar[EventKind] = EventKind.FAILURE

    def handle(self, target: EventTarget) -> list[Event]:
        return target.fail(self.job, self.epoch, self.time_s)


@dataclass(frozen=True, slots=True)
class Schedule(Event):
    kind: ClassVar[EventKind] = EventKind.SCHEDULE

    def handle(self, target: EventTarget) -> list[Event]:
        return target.schedule(self.time_s)


def run_events(initial: Iterable[Event], target: EventTarget,
               on_event: Callable[[Event], None] | None = None) -> int:
    """Handle events in time order (then :class:`EventKind`, then creation) until none is left;
    returns how many were handled."""
    order = itertools.count()
    queue: list[tuple[float, int, int, Event]] = []
    for event in initial:
        heapq.heappush(queue, (event.time_s, event.kind, next(order), event))
    handled = 0
    while queue:
        event = heapq.heappop(queue)[3]
        for caused in event.handle(target):
            if caused.time_s < event.time_s:
                raise ValueError(f"{type(event).__name__} at {event.time_s} s caused an event in the past, "
                                 f"{type(caused).__name__} at {caused.time_s} s")
            heapq.heappush(queue, (caused.time_s, caused.kind, next(order), caused))
        handled += 1
        if on_event is not None:
            on_event(event)
    return handled

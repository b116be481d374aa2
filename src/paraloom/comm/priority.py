"""Priority scheduling (P3 / ByteScheduler): partitions go in the order the next forward needs them.

Every rank must issue collectives in one order (DESIGN.md §3), so the order cannot follow each
rank's own timing as it happens. It is planned instead: from one profiled step — when each
partition became ready after backward began, and the link's seconds per byte — a simulation of
the P3 policy (whenever the credit window has room, launch the ready partition that the next
forward needs first) yields one launch order. The engine feeds the simulation rank 0's
measurements, so every rank computes the same order. Before the plan exists, tasks go in key
order (wait-free).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from paraloom.comm.policies import WaitFreeScheduler, register_scheduler


@dataclass(frozen=True)
class PlanTask:
    key: int  # the task's key (0, 1, ... in the order backward makes them ready)
    nbytes: int
    priority: int  # smaller: the next forward needs it sooner
    ready_at: float  # seconds after backward began


def plan_order(tasks: list[PlanTask], seconds_per_byte: float, credit_bytes: int) -> list[int]:
    """Keys in the order the P3 policy launches them on a link that moves one byte per `seconds_per_byte`.

    Launched tasks queue on the link first in, first out; at most `credit_bytes` are in flight
    (a task larger than the window goes alone). Ties in priority go to the lower key.
    """
    arrivals = sorted(tasks, key=lambda t: (t.ready_at, t.key))
    ready: list[tuple[int, int, PlanTask]] = []
    in_flight: deque[tuple[float, int]] = deque()  # (finishes at, bytes)
    in_flight_bytes, link_free_at, now, order, next_arrival = 0, 0.0, 0.0, [], 0
    while len(order) < len(tasks):
        while next_arrival < len(arrivals) and arrivals[next_arrival].ready_at <= now:
            task = arrivals[next_arrival]
            heapq.heappush(ready, (task.priority, task.key, task))
            next_arrival += 1
        while in_flight and in_flight[0][0] <= now:
            in_flight_bytes -= in_flight.popleft()[1]
        if ready and (not in_flight or in_flight_bytes + ready[0][2].nbytes <= credit_bytes):
            task = heapq.heappop(ready)[2]
            link_free_at = max(now, link_free_at) + task.nbytes * seconds_per_byte
            in_flight.append((link_free_at, task.nbytes))
            in_flight_bytes += task.nbytes
            order.append(task.key)
            continue
        upcoming = [in_flight[0][0]] if in_flight else []
        if next_arrival < len(arrivals):
            upcoming.append(arrivals[next_arrival].ready_at)
        now = min(upcoming)
    return order


@register_scheduler
class PriorityScheduler:
    """Launch tasks in a planned order; key order until a plan is set."""

    name = "priority"
    # what the engine must do for it (comm/policies.py's FifoScheduler says what each means)
    own_group = True  # the credit window's issuing thread launches as this rank's backward goes
    credit_window = True  # the link stays busy while the queue stays reorderable
    cuts_pieces = True  # the plan orders partitions, so the first layers' go out first
    defers_updates = True  # a module's next forward applies its update once its partitions land

    def __init__(self) -> None:
        self.order: list[int] | None = None

    def next_batch(self, ready: list[int], launched: int, flushing: bool) -> list[int]:
        if self.order is None:
            return WaitFreeScheduler.next_batch(ready, launched, flushing)
        waiting, out = set(ready), []
        while launched < len(self.order) and self.order[launched] in waiting:
            out.append(self.order[launched])
            launched += 1
        return out


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: how long the link had something in flight."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total

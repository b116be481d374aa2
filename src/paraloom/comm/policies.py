"""Scheduling policies: the engine submits CommTasks; a pure policy says which to launch when.

Policies are pure functions of plain data, tested with lists:
- `fifo`: nothing while backward runs; at the end, everything in key order (no overlap).
- `wait_free`: launch each task the moment it and every lower key are ready (wait-free
  back-propagation): communication overlaps the rest of backward, in one fixed order.
- `priority` (comm/priority.py): launch in a planned order that puts what the next forward
  needs first.
A policy sees the ready keys and how many tasks it has launched this step, and returns the keys
to launch now; the launch order is the one order every rank issues collectives in (DESIGN.md §3).
The registry of policies is comm/schedulers.py; the executors that run them, comm/executor.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from paraloom.config.choices import registrar


class Handle(Protocol):
    def wait(self) -> Any: ...


@dataclass(order=True)
class CommTask:
    key: int  # launch order on every rank: 0, 1, 2, ...
    nbytes: int = field(compare=False)
    priority: int = field(compare=False, default=0)
    launch: Callable[[], Handle] = field(compare=False, default=None, repr=False)


# every scheduler class by its `name`, filled by `register_scheduler` as its module is imported;
# paraloom.comm.schedulers imports the modules paraloom.config.choices.SCHEDULER_MODULES names
REGISTERED, register_scheduler = registrar("scheduler")


@register_scheduler
class FifoScheduler:
    """Synchronize after backward, in back-propagation order, with no overlap."""

    name = "fifo"
    # What the engine must do for a policy (data_parallel/layout.py, updaters.py, auto.py read these;
    # nothing outside comm/schedulers.py branches on a policy's name):
    # True: launches follow each rank's own progress, so its collectives go on a group of their own
    own_group = False
    # True: the executor bounds the bytes in flight (CreditExecutor, comm.credit_mb)
    credit_window = False
    # True: gradients travel as partitions of comm.partition_mb instead of buckets of comm.bucket_mb
    cuts_pieces = False
    # True: each module's update waits for its next forward (data_parallel/deferred_updates.py)
    defers_updates = False

    @staticmethod
    def next_batch(ready: list[int], launched: int, flushing: bool) -> list[int]:
        return sorted(ready) if flushing else []


@register_scheduler
class WaitFreeScheduler:
    """Launch every task as soon as it is ready and all tasks before it have been launched."""

    name = "wait_free"
    own_group = False  # launched from backward's own thread, in key order: the engine's group will do
    credit_window = False  # every ready bucket goes at once
    cuts_pieces = False  # whole buckets
    defers_updates = False  # one optimizer step after the average

    @staticmethod
    def next_batch(ready: list[int], launched: int, flushing: bool) -> list[int]:
        waiting, out, next_key = set(ready), [], launched
        while next_key in waiting:
            out.append(next_key)
            next_key += 1
        return out

"""Communication scheduling: the engine submits CommTasks; a pure policy says which to launch when.

Policies are pure functions of plain data, tested with lists:
- `fifo`: nothing while backward runs; at the end, everything in key order (no overlap).
- `wait_free`: launch each task the moment it and every lower key are ready (wait-free
  back-propagation): communication overlaps the rest of backward, in one fixed order.
Keys give the one order every rank issues collectives in (DESIGN.md §3).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from paraloom.errors import UserError


class Handle(Protocol):
    def wait(self) -> Any: ...


@dataclass(order=True)
class CommTask:
    key: int  # launch order on every rank: 0, 1, 2, ...
    nbytes: int = field(compare=False)
    priority: int = field(compare=False, default=0)
    launch: Callable[[], Handle] = field(compare=False, default=None, repr=False)


class FifoScheduler:
    """Synchronize after backward, in back-propagation order, with no overlap."""

    name = "fifo"

    @staticmethod
    def next_batch(ready: list[int], next_key: int, flushing: bool) -> list[int]:
        return sorted(k for k in ready if k >= next_key) if flushing else []


class WaitFreeScheduler:
    """Launch every task as soon as it is ready and all tasks before it have been launched."""

    name = "wait_free"

    @staticmethod
    def next_batch(ready: list[int], next_key: int, flushing: bool) -> list[int]:
        waiting, out = set(ready), []
        while next_key in waiting:
            out.append(next_key)
            next_key += 1
        return out


SCHEDULERS = {"fifo": FifoScheduler, "wait_free": WaitFreeScheduler}


def make_scheduler(name: str):
    if name not in SCHEDULERS:
        raise UserError(f"comm.scheduler={name!r} is not known; choose one of: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]()


class Executor:
    """Holds one step's tasks, asks the policy what to launch, and waits for them at the end."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self._ready: dict[int, CommTask] = {}
        self._next = 0
        self._handles: list[tuple[CommTask, Handle]] = []

    @property
    def launched(self) -> int:
        """Tasks launched so far in this step."""
        return len(self._handles)

    def reset(self) -> None:
        if self._handles or self._ready:
            raise RuntimeError("reset while communication of the last step is still pending")
        self._next = 0

    def mark_ready(self, task: CommTask) -> None:
        self._ready[task.key] = task
        self._launch(flushing=False)

    def _launch(self, flushing: bool) -> None:
        for key in self.policy.next_batch(list(self._ready), self._next, flushing):
            task = self._ready.pop(key)
            self._handles.append((task, task.launch()))
            self._next = key + 1

    def wait_all(self, total: int) -> list[CommTask]:
        """Launch what is left (all `total` tasks must be ready by now) and wait for every one."""
        missing = sorted(set(range(self._next, total)) - set(self._ready))
        if missing:
            raise RuntimeError(f"communication tasks {missing} were never marked ready")
        self._launch(flushing=True)
        done = []
        for task, handle in self._handles:
            handle.wait()
            done.append(task)
        self._handles = []
        return done


class CommThread:
    """One background thread that runs blocking collectives in submission order.

    For algorithms written on point-to-point messages, which have no asynchronous form: the
    thread is the single issuer, so every rank still issues collectives in the same order.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="paraloom-comm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.error = exc
            done.set()

    def submit(self, fn: Callable[[], Any]) -> Handle:
        done = _Done()
        self._jobs.put((fn, done))
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


class _Done(threading.Event):
    error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        super().wait(timeout)
        if self.error is not None:
            raise self.error
        return True

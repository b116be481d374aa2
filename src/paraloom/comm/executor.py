"""Executors of a scheduling policy: hold a step's CommTasks, launch what the policy says, wait.

`Executor` launches from the calling thread; `CreditExecutor` keeps at most a credit of bytes
in flight (priority scheduling); `CommThread` is the one background thread that issues the
hand-written algorithms' messages in the policy's order (DESIGN.md §3).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from paraloom.comm.policies import CommTask, Handle


class Executor:
    """Holds one step's tasks, asks the policy what to launch, and waits for them (one thread)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self._ready: dict[int, CommTask] = {}
        self._launched: dict[int, tuple[CommTask, Handle]] = {}  # this step, in launch order
        self._waited: set[int] = set()
        self._flushing = False
        self._guard = contextlib.nullcontext()  # the threaded executor guards this state with a lock

    @property
    def launched(self) -> int:
        """Tasks launched so far in this step."""
        with self._guard:
            return len(self._launched)

    def reset(self) -> None:
        with self._guard:
            if self._ready or len(self._waited) < len(self._launched):
                raise RuntimeError("reset while communication of the last step is still pending")
            self._launched.clear()
            self._waited.clear()
            self._flushing = False

    def mark_ready(self, task: CommTask) -> None:
        self._ready[task.key] = task
        self._launch()

    def _launch(self) -> None:
        for key in self.policy.next_batch(list(self._ready), len(self._launched), self._flushing):
            task = self._ready.pop(key)
            self._launched[key] = (task, task.launch())

    def flush(self, total: int) -> None:
        """Backward is over: launch what is left; every one of the step's `total` tasks must be ready."""
        _check_complete(total, self._ready, self._launched)
        self._flushing = True
        self._launch()
        if self._ready:
            raise RuntimeError(f"the scheduler left tasks {sorted(self._ready)} unlaunched")

    def wait(self, key: int) -> CommTask | None:
        """Wait for one launched task; None if it was already waited for."""
        if key in self._waited:
            return None
        if key not in self._launched:
            raise RuntimeError(f"communication task {key} was waited for before it was launched")
        task, handle = self._launched[key]
        handle.wait()
        self._waited.add(key)
        return task

    def wait_all(self, total: int) -> list[CommTask]:
        """Launch what is left (all `total` tasks must be ready by now) and wait for every one."""
        self.flush(total)
        return [task for task in map(self.wait, list(self._launched)) if task is not None]

    def close(self) -> None:
        pass


def _check_complete(total: int, ready: dict, launched: dict) -> None:
    if len(launched) + len(ready) != total:
        missing = sorted(k for k in range(total) if k not in ready and k not in launched)
        raise RuntimeError(f"communication tasks {missing} were never marked ready")


class CreditExecutor(Executor):
    """An Executor whose launches happen on one issuing thread, with at most `credit_bytes` in flight.

    The thread launches the policy's next task as soon as it is ready and the credit window has
    room (a task larger than the window goes alone), so the link stays busy between the engine's
    calls while the queue of unlaunched tasks stays reorderable. The launch *order* is the
    policy's, the same on every rank; only launch *times* follow this rank's progress — so the
    collectives must go to a process group nothing else issues on.
    """

    def __init__(self, policy, credit_bytes: int) -> None:
        super().__init__(policy)
        self.credit_bytes = credit_bytes
        self._cond = self._guard = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._completion = threading.Event()  # set whenever a launched task completes
        self._thread = threading.Thread(target=self._run, name="paraloom-issuer", daemon=True)
        self._thread.start()

    def _next(self) -> CommTask | None:
        keys = self.policy.next_batch(list(self._ready), len(self._launched), self._flushing)
        return self._ready[keys[0]] if keys else None

    def _run(self) -> None:
        in_flight: list[_InFlight] = []  # oldest first
        try:
            while True:
                with self._cond:
                    while not self._closed and (task := self._next()) is None:
                        self._cond.wait()
                    if self._closed:
                        return
                while True:  # no lock held here: completion callbacks run under the work's own lock
                    self._completion.clear()
                    in_flight = [f for f in in_flight if not f.completed()]
                    if not in_flight or sum(f.nbytes for f in in_flight) + task.nbytes <= self.credit_bytes:
                        break
                    # woken by a completion callback; handles without one are polled
                    self._completion.wait(timeout=None if all(f.notifies for f in in_flight) else 0.002)
                    if self._closed:
                        return
                handle = task.launch()
                in_flight.append(_InFlight(task.nbytes, handle, self._completion))
                with self._cond:
                    del self._ready[task.key]
                    self._launched[task.key] = (task, handle)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def mark_ready(self, task: CommTask) -> None:
        with self._cond:
            self._ready[task.key] = task
            self._cond.notify_all()

    def flush(self, total: int) -> None:
        with self._cond:
            _check_complete(total, self._ready, self._launched)
            self._flushing = True
            self._cond.notify_all()

    def wait(self, key: int) -> CommTask | None:
        with self._cond:
            if key in self._waited:
                return None
            if key not in self._ready and key not in self._launched:
                raise RuntimeError(f"communication task {key} was waited for before it was ready")
            while key not in self._launched and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            task, handle = self._launched[key]
        handle.wait()
        with self._cond:
            self._waited.add(key)
        return task

    def wait_all(self, total: int) -> list[CommTask]:
        self.flush(total)
        done = []
        while True:
            with self._cond:
                while self._error is None and self._ready and \
                        all(k in self._waited for k in self._launched):
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                key = next((k for k in self._launched if k not in self._waited), None)
            if key is None:
                return done
            done.append(self.wait(key))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._completion.set()
        self._thread.join(timeout=5)


def _completed(handle: Handle) -> bool:
    probe = getattr(handle, "is_completed", None)
    return bool(probe()) if probe is not None else False


class _InFlight:
    """A launched task's bytes and completion, as its future's callback reports it.

    A torch.distributed work's future can complete a moment before `work.is_completed()` turns
    true, so the callback's own flag is what counts; handles without a future are polled.
    """

    def __init__(self, nbytes: int, handle: Handle, wake: threading.Event) -> None:
        self.nbytes = nbytes
        self.handle = handle
        self.notifies = hasattr(handle, "get_future")
        self.done = False
        if self.notifies:
            handle.get_future().add_done_callback(lambda _: self._finished(wake))

    def _finished(self, wake: threading.Event) -> None:
        self.done = True
        wake.set()

    def completed(self) -> bool:
        return self.done if self.notifies else _completed(self.handle)


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

    def is_completed(self) -> bool:
        return self.is_set()

    def wait(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        super().wait(timeout)
        if self.error is not None:
            raise self.error
        return True

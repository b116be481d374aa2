"""Chrome-trace timelines: spans on lanes per rank, per-module forward/backward spans, async works' spans."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class Timeline:
    """Complete ("X") events of one rank, recorded only while `active`; lanes become trace rows.

    `span` may be called from any thread (the training loop, a communication thread, gloo
    completion callbacks). Times are `time.perf_counter()` seconds; the file holds microseconds
    since this Timeline was made.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.active = False  # the trainer turns this on for the traced steps only
        self.origin = time.perf_counter()
        self.origin_unix_s = time.time()  # lets a reader line up the ranks' files
        self._lanes: dict[str, int] = {}  # lane -> tid, in first-use order
        self._events: list[tuple[str, int, float, float, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str, lane: str, start: float, end: float, **args: Any) -> None:
        """Record `name` from `start` to `end` (perf_counter seconds) on `lane`, if active."""
        if not self.active:
            return
        with self._lock:
            tid = self._lanes.setdefault(lane, len(self._lanes) + 1)
            self._events.append((name, tid, start, end, args))

    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace-event document (the JSON object `write` saves)."""
        with self._lock:
            lanes, events = dict(self._lanes), list(self._events)
        pid = self.rank
        out: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": f"rank {pid}"}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
        ]
        for lane, tid in lanes.items():
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                        "args": {"sort_index": tid}})
        lane_of = {tid: lane for lane, tid in lanes.items()}
        for name, tid, start, end, args in events:
            out.append({"name": name, "cat": lane_of[tid], "ph": "X", "pid": pid, "tid": tid,
                        "ts": (start - self.origin) * 1e6, "dur": max(end - start, 0.0) * 1e6,
                        "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"rank": pid, "origin_unix_s": self.origin_unix_s}}

    def write(self, path: str | Path) -> Path:
        """Save the trace atomically (a temporary file, then a rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_chrome(), default=str))
        os.replace(tmp, path)
        return path


class WorkSpans:
    """Spans from a start time to the completion of an asynchronous `dist.Work`, timed on one thread
    per key (e.g. per peer) that only waits and records: it issues no communication.

    gloo's point-to-point Work cannot say when it is done: in torch 2.13 `is_completed()` stayed
    False through 3 s of polling until `wait()` was called, and `get_future()` raises "Work::getFuture
    not implemented". With `owns_wait` the thread waits on each work (in the order watched) and the
    caller must not: a gloo send waited twice hangs until the group's timeout. Without it (backends
    whose works report completion) the thread polls `is_completed()` and the caller waits as usual.
    """

    def __init__(self, timeline: Timeline, lane: str, *, owns_wait: bool) -> None:
        self.timeline, self.lane, self.owns_wait = timeline, lane, owns_wait
        self._queues: dict[Any, queue.SimpleQueue] = {}  # key -> (work, keep, name, start, args)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def watch(self, key: Any, work: Any, name: str, start: float, *, keep: Any = None, **args: Any) -> None:
        """Record `name` from `start` until `work` completes; `keep` (its tensor) stays alive till then."""
        if key not in self._queues:
            self._queues[key] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(self._queues[key],), daemon=True,
                                      name=f"paraloom-work-spans-{key}")
            thread.start()
            self._threads.append(thread)
        self._queues[key].put((work, keep, name, start, args))

    def _run(self, works: queue.SimpleQueue) -> None:
        while (item := works.get()) is not None:
            work, _, name, start, args = item
            try:
                if self.owns_wait:
                    work.wait()
                else:
                    while not work.is_completed():
                        time.sleep(1e-4)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by join()
                self._errors.append(e)
                return
            self.timeline.span(name, self.lane, start, self.timeline.now(), **args)

    def join(self) -> None:
        """Return once every watched work completed and its span is recorded; re-raise a failed wait."""
        for works in self._queues.values():
            works.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()
        if self._errors:
            raise self._errors.pop(0)


class _ModuleSpans:
    """Forward and backward spans of one module that owns parameters.

    Backward starts when the gradient of the module's output arrives (a hook on that tensor, set
    during a traced forward) and ends when every trainable parameter of the module has its
    gradient accumulated. torch's full backward hooks are not used: for a module whose input needs
    no gradient (the first layer) they fire when backward *reaches* the module, not when it is
    done, and they make in-place operations on the module's output fail.
    """

    def __init__(self, label: str, params: list[nn.Parameter], timeline: Timeline) -> None:
        self.forward_name, self.backward_name = f"forward {label}", f"backward {label}"
        self.timeline = timeline
        self.expected = len(params)
        self.forward_start: float | None = None
        self.backward_start: float | None = None
        self.accumulated: set[int] = set()

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if self.timeline.active:
            self.forward_start = self.timeline.now()

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        timeline, start = self.timeline, self.forward_start
        if not timeline.active or start is None:
            return
        self.forward_start = None
        timeline.span(self.forward_name, "compute", start, timeline.now())
        grad_output = _first_grad_tensor(output) if torch.is_grad_enabled() else None
        if grad_output is not None and self.expected:
            grad_output.register_hook(self.output_grad_ready)

    def output_grad_ready(self, grad: torch.Tensor) -> None:
        if self.accumulated:  # an earlier backward left some parameter without a gradient
            self.accumulated.clear()
            self.backward_start = None
        if self.backward_start is None:
            self.backward_start = self.timeline.now()

    def grad_accumulated(self, param: torch.Tensor) -> None:
        start = self.backward_start
        if start is None:
            return
        self.accumulated.add(id(param))
        if len(self.accumulated) >= self.expected:
            self.timeline.span(self.backward_name, "compute", start, self.timeline.now())
            self.backward_start = None
            self.accumulated.clear()


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def trace_modules(module: nn.Module, timeline: Timeline) -> list[RemovableHandle]:
    """Record "forward NAME" / "backward NAME" on lane "compute" for every module owning parameters.

    Spans are recorded only while `timeline.active`; an inactive timeline costs one check per
    module call. Returns the hook handles (`handle.remove()` detaches them).
    """
    handles: list[RemovableHandle] = []
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        if not own:
            continue
        trainable = [p for p in own if p.requires_grad]
        spans = _ModuleSpans(name or type(sub).__name__, trainable, timeline)
        handles.append(sub.register_forward_pre_hook(spans.before_forward))
        handles.append(sub.register_forward_hook(spans.after_forward))
        handles += [p.register_post_accumulate_grad_hook(spans.grad_accumulated) for p in trainable]
    return handles

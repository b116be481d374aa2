"""One parameter server: owns a shard, applies pushes, answers reads when the consistency rule allows.

Messages are c10d point-to-point (gloo over TCP; NCCL on GPUs) in the format of message.py: one
request per worker per step (its gradient and the request for the next parameters) and one
reply for each slice of the shard (a slice has state of its own: parameters, optimizer, clocks,
version; `serve` runs all of one process's slices). Every worker's next request of every slice
has a receive posted for it (a thread per worker and slice waits on it), so all gradients stream
in at once; the server handles them one at a time in the order they arrive (its state needs no
lock). A single any-source receive would let gloo stall every sender but the one it matched,
and the links would idle between messages.

BSP sums the W pushes of a clock and takes one optimizer step with their mean — the update of
synchronous all-reduce SGD. ASP and SSP take a step per push, with the gradient divided by W
(so W pushes move the parameters as far as one BSP step). A push's staleness is the number of
updates the server applied between the worker's read and its push. A request whose run token
is not the server's is refused: nothing is applied, the worker is told, and counts as gone.

A push whose gradient holds NaN or Inf is dropped, not applied; the worker's clock still advances,
so that BSP and SSP do not wait for it forever. BSP then steps with the mean of the finite pushes
of the clock (none finite: no step). Snapshots are consistent cuts: a push marked SNAP at clock c
has its read held, whatever the consistency rule, until every slice of this process has every
worker's SNAP push of clock c (a worker that has left is not waited for); then `on_snapshot` gets
every slice's `state_dict()` and the held reads are answered. No worker can push clock c + 1
before its read of clock c is answered, so each slice's state holds exactly c pushes of every
worker, and `load_state_dict` on fresh servers resumes from there as if never interrupted.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paraloom.optim.finite import is_finite
from paraloom.parameter_server.consistency import may_read
from paraloom.parameter_server.message import (
    DONE,
    NONFINITE,
    OK,
    PULL,
    PUSH,
    REFUSED,
    SNAP,
    Message,
    PushCodec,
    reply_tag,
    request_tag,
)

GONE = 1 << 30  # the clock of a worker that has left: it never holds the others back


class ParameterServer:
    """One slice's state; `slot` is the slice's index at its server (its messages' tags)."""

    def __init__(self, shard: torch.Tensor, optimizer_factory, *, workers: list[int], bound: int | None,
                 average: bool, token: int = 0, codec: PushCodec | None = None, slot: int = 0,
                 clip_norm: float | None = None) -> None:
        self.slot = slot
        self.param = torch.nn.Parameter(shard.detach().clone())
        self.param.grad = torch.zeros_like(self.param)
        self.optimizer = optimizer_factory([self.param])
        self.workers = workers
        self.bound = bound
        self.average = average  # BSP: one step per clock with the mean of its finite pushes
        self.token = token
        self.codec = codec or PushCodec(self.param.numel())
        self.clocks = {w: 0 for w in workers}
        self.version = 0  # optimizer steps taken
        self.pending: list[tuple[int, int]] = []  # reads (worker, clock) not yet allowed
        self.held: list[tuple[int, int]] = []  # reads of SNAP pushes, answered after the snapshot
        self.marked: dict[int, int] = {}  # worker -> clock of its SNAP push awaiting the snapshot
        self.summed = 0  # BSP: finite pushes summed into .grad for the current clock
        self.arrived = 0  # BSP: pushes of the current clock, dropped ones included
        self.clip_norm = clip_norm  # BSP: clip the mean gradient to this norm over the WHOLE model
        self.deferred: int | None = None  # clipping: a complete clock's summed pushes, awaiting the norm
        self.staleness: Counter[int] = Counter()  # per applied push: updates applied since its read
        self.read_staleness: Counter[int] = Counter()  # per read: reader's clock - slowest clock
        self.received = {w: 0 for w in workers}  # pushes from each worker, applied or dropped
        self.pushes_applied = 0
        self.dropped = 0  # pushes holding NaN or Inf, not applied
        self.refused = 0
        self.busy_seconds = 0.0
        self.update_seconds = 0.0  # this thread's CPU in optimizer steps (the perf model's per update)
        self._cached: tuple[tuple[int, int], Message] | None = None  # the last OK reply's message
        self._sends: dict[int, tuple[Any, Message]] = {}  # the last reply to each worker

    def serve(self, on_snapshot: Callable[[int, list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
        """Run until every worker has said it is done; returns this server's metrics."""
        return serve([self], on_snapshot)

    def handle(self, src: int, message: Message) -> bool:
        """Apply a worker's request (then `answer`); whether the worker has left."""
        flags, clock, version, token = message.read_header()
        leaving = token != self.token or bool(flags & DONE)
        began = time.perf_counter()
        if leaving:
            if token != self.token:
                self.refused += 1
                self._reply(src, REFUSED)
            self.clocks[src] = GONE
        else:
            snap = flags & (SNAP | PUSH) == SNAP | PUSH
            if flags & PUSH:
                self._push(src, flags, clock, version, message)
            if snap:
                self.marked[src] = clock
            if flags & PULL:
                (self.held if snap else self.pending).append((src, clock))
        self.busy_seconds += time.perf_counter() - began
        return leaving

    def in_turn(self, src: int, message: Message) -> bool:
        """Whether a request may be handled now. BSP sums a clock's pushes in worker order, whatever
        order they arrive in: a float sum of three or more depends on its order, and arrival order
        made two runs differ in the last bits. A push that comes early waits, unread, in its
        receive buffer (no copy) until every lower worker's push of its clock is in."""
        flags, clock, _, token = message.read_header()
        if not (self.average and flags & PUSH) or token != self.token:
            return True
        return all(self.clocks[w] >= clock for w in self.workers if w < src)

    def answer(self) -> None:
        """Reply to every pending read the consistency rule now allows (none while a clipped step
        waits for the global norm)."""
        if self.deferred is not None:
            return
        began = time.perf_counter()
        self._answer()
        self.busy_seconds += time.perf_counter() - began

    def finish(self) -> None:
        for send, _ in self._sends.values():
            send.wait()

    def release_held(self) -> None:
        """After a snapshot: its held reads join the others, to be answered by the usual rule."""
        self.pending += self.held
        self.held, self.marked = [], {}

    def state_dict(self) -> dict[str, Any]:
        """Everything serving depends on, as copies (tensors, numbers, lists and dicts only, so it
        loads with `torch.load(weights_only=True)`); reads on their way are not part of it."""
        return {"param": self.param.detach().clone(), "grad": self.param.grad.clone(),  # BSP's partial sum
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "clocks": dict(self.clocks), "version": self.version, "summed": self.summed,
                "arrived": self.arrived, "pushes_applied": self.pushes_applied, "dropped": self.dropped,
                "refused": self.refused, "received": dict(self.received),
                "staleness": dict(self.staleness), "read_staleness": dict(self.read_staleness)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output (of a slice of the same size and workers)."""
        if state["param"].shape != self.param.shape:
            raise ValueError(f"slice {self.slot} holds {self.param.numel()} parameters; the state has "
                             f"{state['param'].numel()}: load the state of the same slice of the same model")
        if sorted(state["clocks"]) != sorted(self.workers):
            raise ValueError(f"the state is of workers {sorted(state['clocks'])}; this server serves "
                             f"{sorted(self.workers)}")
        self.param.copy_(state["param"])
        self.param.grad.copy_(state["grad"])
        # a copy: the optimizer adopts the state's tensors and would change them step by step
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.clocks = {int(w): int(c) for w, c in state["clocks"].items()}
        self.received = {int(w): int(c) for w, c in state["received"].items()}
        for name in ("version", "summed", "arrived", "pushes_applied", "dropped", "refused"):
            setattr(self, name, int(state[name]))
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        self.read_staleness = Counter({int(k): int(v) for k, v in state["read_staleness"].items()})
        self._cached = None

    def _push(self, src: int, flags: int, clock: int, version: int, message: Message) -> None:
        grad = None if flags & NONFINITE else self.codec.decode(message.body)
        # one sum over the decoded slice: a compressed push can also turn non-finite in
        # decoding (an fp16 overflow), which the worker's own check before encoding cannot see
        if grad is not None and not is_finite(grad):
            grad = None
        self.received[src] += 1
        if grad is None:
            self.dropped += 1
        else:
            self.staleness[self.version - version] += 1
            self.pushes_applied += 1
        self._apply(grad)
        self.clocks[src] = clock

    @torch.no_grad()
    def _apply(self, grad: torch.Tensor | None) -> None:
        """Apply one push's gradient (None: a dropped push, which still completes a BSP clock)."""
        n = len(self.workers)
        if self.average:
            if grad is not None:
                self.param.grad.add_(grad)
                self.summed += 1
            self.arrived += 1
            if self.arrived < n:
                return
            summed, self.summed, self.arrived = self.summed, 0, 0
            if summed:
                self.param.grad.div_(summed)
            if self.clip_norm is not None:  # the step waits for the norm over every slice: step_clipped
                self.deferred = summed
                return
            if summed == 0:  # every push of the clock was dropped: nothing to step with
                return
        elif grad is None:
            return
        else:
            torch.div(grad, n, out=self.param.grad)
        self.step()

    def step(self) -> None:
        began = time.thread_time()
        self.optimizer.step()
        self.param.grad.zero_()
        self.version += 1
        self.update_seconds += time.thread_time() - began

    def _slowest(self) -> int:
        return min(self.clocks.values())

    def _answer(self) -> None:
        still = []
        for worker, clock in self.pending:
            if not may_read(clock, self.clocks.values(), self.bound):
                still.append((worker, clock))
                continue
            self.read_staleness[max(0, clock - self._slowest())] += 1
            self._reply(worker, OK)
        self.pending = still

    def _reply(self, worker: int, status: int) -> None:
        if status != OK:
            message = Message(self.param.numel(), torch.float32)
            message.write_header(-1, status, self._slowest())
        else:
            key = (self.version, self._slowest())
            if self._cached is None or self._cached[0] != key:
                # replies are sent asynchronously; later steps must not change what is on its way
                message = Message(self.param.numel(), torch.float32)
                message.body.copy_(self.param.detach())
                message.write_header(key[0], OK, key[1])
                self._cached = (key, message)
            message = self._cached[1]
        previous = self._sends.get(worker)
        if previous is not None:  # done long ago: the worker has received it and asked again since
            previous[0].wait()
        self._sends[worker] = (dist.isend(message.buffer, worker, tag=reply_tag(self.slot)), message)


def serve(slices: list[ParameterServer],
          on_snapshot: Callable[[int, list[dict[str, Any]]], None] | None = None,
          norm_group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Serve one process's slices (slice j has slot j) until every worker has said it is done to
    each; returns the server's metrics, summed over its slices (a push is one slice's gradient).

    `on_snapshot(clock, [slice.state_dict() for slice in slices])` is called on this thread once
    every worker's SNAP pushes of `clock` are in (see the module's docstring); the workers wait
    for it, so it may write a checkpoint and run collectives on a group of its own.
    """
    if [s.slot for s in slices] != list(range(len(slices))):
        raise ValueError(f"slices must come in slot order 0..{len(slices) - 1}")
    cpu = time.process_time()
    inbox = Inbox([s.codec for s in slices], slices[0].workers, slices[0].token)
    active = len(slices) * len(slices[0].workers)
    gathering = False  # some SNAP push is in: look for the last one after each request
    early: list[tuple[int, int, Message]] = []  # BSP pushes that came before their turn (`in_turn`)
    while active:
        ready = [inbox.next()]
        while ready:
            src, slot, message = ready.pop()
            if not slices[slot].in_turn(src, message):
                early.append((src, slot, message))
                continue
            active -= slices[slot].handle(src, message)
            inbox.release(src, slot)  # the next request's receive is posted before the replies go out
            if all(s.deferred is not None for s in slices):
                step_clipped(slices, norm_group)
            slices[slot].answer()
            gathering = gathering or bool(slices[slot].marked)
            if gathering and (clock := _snapshot_clock(slices)) is not None:
                if on_snapshot is not None:
                    on_snapshot(clock, [s.state_dict() for s in slices])
                for piece in slices:
                    piece.release_held()
                    piece.answer()
                gathering = False
            ready += [e for e in early if slices[e[1]].in_turn(e[0], e[2])]
            early = [e for e in early if e not in ready]
    for piece in slices:
        piece.finish()
    return {"slices": len(slices),
            "pushes_applied": sum(s.pushes_applied for s in slices),
            "dropped": sum(s.dropped for s in slices),
            "received": [slices[0].received[w] for w in slices[0].workers],  # per worker, on slice 0
            "updates": sum(s.version for s in slices), "refused": max(s.refused for s in slices),
            "staleness": _merged(s.staleness for s in slices),
            "read_staleness": _merged(s.read_staleness for s in slices),
            "busy_seconds": sum(s.busy_seconds for s in slices),  # handling requests (wall clock)
            "update_cpu_seconds": sum(s.update_seconds for s in slices),
            "cpu_seconds": time.process_time() - cpu}  # all threads, the receiving ones included


@torch.no_grad()
def step_clipped(slices: list[ParameterServer], group: dist.ProcessGroup | None) -> None:
    """BSP's clipped step of a clock every slice has in full: the mean gradients' global L2 norm
    (squares summed here, then over `group`, the server processes), each scaled by
    `min(1, clip_norm / (norm + 1e-6))` as torch's `clip_grad_norm_` does, then each slice steps
    (a slice whose pushes were all dropped does not) and answers its reads. No worker can push the
    next clock before these replies, so every server process reaches this once per clock."""
    sq = torch.zeros((), dtype=torch.float64)
    for s in slices:
        sq += s.param.grad.double().square().sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    coef = min(1.0, slices[0].clip_norm / (float(sq.sqrt()) + 1e-6))
    for s in slices:
        if s.deferred:
            s.param.grad.mul_(coef)
            s.step()
        s.deferred = None
        s.answer()


def _snapshot_clock(slices: list[ParameterServer]) -> int | None:
    """The clock of the snapshot the workers marked, once every slice has every present worker's
    SNAP push of it; None while some are missing. Raises on marks the protocol rules out (they
    would leave the marked workers waiting forever)."""
    marks = {clock for s in slices for clock in s.marked.values()}
    if len(marks) > 1:
        raise RuntimeError(f"workers marked snapshots at clocks {sorted(marks)}; every worker must call "
                           f"mark_snapshot() at the same step")
    if not marks:
        return None
    (mark,) = marks
    due = True
    for s in slices:
        for worker, clock in s.clocks.items():
            if clock == GONE or worker in s.marked:
                continue
            if clock >= mark:
                raise RuntimeError(f"worker {worker} pushed clock {clock} to slice {s.slot} without a "
                                   f"snapshot mark, while others marked clock {mark}: a snapshot's step "
                                   f"must mark every slice (call mark_snapshot() before backward)")
            due = False
    return mark if due else None


def _merged(counters) -> dict[int, int]:
    total: Counter[int] = Counter()
    for counter in counters:
        total.update(counter)
    return dict(sorted(total.items()))


class Inbox:
    """A receive posted for every worker's next request of every slice, each waited on by a thread
    of its own; `next()` returns requests in the order they complete, `release(src, slot)` lets
    that buffer be reused."""

    def __init__(self, codecs: list[PushCodec], workers: list[int], token: int) -> None:
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()
        keys = [(w, slot) for w in workers for slot in range(len(codecs))]
        self.messages = {(w, slot): codecs[slot].message() for w, slot in keys}
        self.free = {key: threading.Semaphore(0) for key in keys}
        self.token = token
        for w, slot in keys:
            threading.Thread(target=self._receive, args=(w, slot), name=f"ps-inbox-{w}-{slot}",
                             daemon=True).start()

    def _receive(self, worker: int, slot: int) -> None:
        message = self.messages[worker, slot]
        while True:
            try:
                dist.irecv(message.buffer, worker, tag=request_tag(slot)).wait()
            except Exception as error:  # a dead or hung worker: the server's loop raises it
                self.arrived.put((worker, slot, error))
                return
            flags, _, _, token = message.read_header()
            self.arrived.put((worker, slot, None))
            if flags & DONE or token != self.token:  # the worker's last request
                return
            self.free[worker, slot].acquire()

    def next(self) -> tuple[int, int, Message]:
        worker, slot, error = self.arrived.get()
        if error is not None:
            raise error
        return worker, slot, self.messages[worker, slot]

    def release(self, worker: int, slot: int) -> None:
        self.free[worker, slot].release()

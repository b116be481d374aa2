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
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from paraloom.parameter_server.consistency import may_read
from paraloom.parameter_server.message import (
    DONE,
    OK,
    PULL,
    PUSH,
    REFUSED,
    Message,
    PushCodec,
    reply_tag,
    request_tag,
)

GONE = 1 << 30  # the clock of a worker that has left: it never holds the others back


class ParameterServer:
    """One slice's state; `slot` is the slice's index at its server (its messages' tags)."""

    def __init__(self, shard: torch.Tensor, optimizer_factory, *, workers: list[int], bound: int | None,
                 average: bool, token: int = 0, codec: PushCodec | None = None, slot: int = 0) -> None:
        self.slot = slot
        self.param = torch.nn.Parameter(shard.detach().clone())
        self.param.grad = torch.zeros_like(self.param)
        self.optimizer = optimizer_factory([self.param])
        self.workers = workers
        self.bound = bound
        self.average = average  # BSP: one step per clock with the mean of all pushes
        self.token = token
        self.codec = codec or PushCodec(self.param.numel())
        self.clocks = {w: 0 for w in workers}
        self.version = 0  # optimizer steps taken
        self.pending: list[tuple[int, int]] = []  # reads (worker, clock) not yet allowed
        self.summed = 0  # BSP: pushes summed into .grad for the current clock
        self.staleness: Counter[int] = Counter()  # per push: updates applied since its read
        self.read_staleness: Counter[int] = Counter()  # per read: reader's clock - slowest clock
        self.pushes_applied = 0
        self.refused = 0
        self.busy_seconds = 0.0
        self._snapshot: tuple[tuple[int, int], Message] | None = None
        self._sends: dict[int, tuple[Any, Message]] = {}  # the last reply to each worker

    def serve(self) -> dict[str, Any]:
        """Run until every worker has said it is done; returns this server's metrics."""
        return serve([self])

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
            if flags & PUSH:
                self._apply(self.codec.decode(message.body), version)
                self.clocks[src] = clock
            if flags & PULL:
                self.pending.append((src, clock))
        self.busy_seconds += time.perf_counter() - began
        return leaving

    def answer(self) -> None:
        """Reply to every pending read the consistency rule now allows."""
        began = time.perf_counter()
        self._answer()
        self.busy_seconds += time.perf_counter() - began

    def finish(self) -> None:
        for send, _ in self._sends.values():
            send.wait()

    @torch.no_grad()
    def _apply(self, grad: torch.Tensor, version: int) -> None:
        self.staleness[self.version - version] += 1
        self.pushes_applied += 1
        n = len(self.workers)
        if self.average:
            self.param.grad.add_(grad)
            self.summed += 1
            if self.summed < n:
                return
            self.param.grad.div_(n)
            self.summed = 0
        else:
            torch.div(grad, n, out=self.param.grad)
        self.optimizer.step()
        self.param.grad.zero_()
        self.version += 1

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
            if self._snapshot is None or self._snapshot[0] != key:
                # replies are sent asynchronously; later steps must not change what is on its way
                message = Message(self.param.numel(), torch.float32)
                message.body.copy_(self.param.detach())
                message.write_header(key[0], OK, key[1])
                self._snapshot = (key, message)
            message = self._snapshot[1]
        previous = self._sends.get(worker)
        if previous is not None:  # done long ago: the worker has received it and asked again since
            previous[0].wait()
        self._sends[worker] = (dist.isend(message.buffer, worker, tag=reply_tag(self.slot)), message)


def serve(slices: list[ParameterServer]) -> dict[str, Any]:
    """Serve one process's slices (slice j has slot j) until every worker has said it is done to
    each; returns the server's metrics, summed over its slices (a push is one slice's gradient)."""
    if [s.slot for s in slices] != list(range(len(slices))):
        raise ValueError(f"slices must come in slot order 0..{len(slices) - 1}")
    cpu = time.process_time()
    inbox = Inbox([s.codec for s in slices], slices[0].workers, slices[0].token)
    active = len(slices) * len(slices[0].workers)
    while active:
        src, slot, message = inbox.next()
        active -= slices[slot].handle(src, message)
        inbox.release(src, slot)  # the next request's receive is posted before the replies go out
        slices[slot].answer()
    for piece in slices:
        piece.finish()
    return {"slices": len(slices),
            "pushes_applied": sum(s.pushes_applied for s in slices),
            "updates": sum(s.version for s in slices), "refused": max(s.refused for s in slices),
            "staleness": _merged(s.staleness for s in slices),
            "read_staleness": _merged(s.read_staleness for s in slices),
            "busy_seconds": sum(s.busy_seconds for s in slices),  # handling requests (wall clock)
            "cpu_seconds": time.process_time() - cpu}  # all threads, the receiving ones included


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

"""One parameter server: owns a shard, applies pushes, answers reads when the consistency rule allows.

Messages are c10d point-to-point (gloo over TCP; NCCL on GPUs) in the format of message.py: one
request per worker per step (its gradient and the request for the next parameters) and one
reply. Every worker's next request has a receive posted for it (a thread per worker waits on
it), so all workers' gradients stream in at once; the server handles them one at a time in
the order they arrive (its state needs no lock). A single any-source receive would let gloo
stall every sender but the one it matched, and the links would idle between messages.

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
    REPLY,
    REQUEST,
    Message,
    PushCodec,
)

GONE = 1 << 30  # the clock of a worker that has left: it never holds the others back


class ParameterServer:
    def __init__(self, shard: torch.Tensor, optimizer_factory, *, workers: list[int], bound: int | None,
                 average: bool, token: int = 0, codec: PushCodec | None = None) -> None:
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
        cpu = time.process_time()
        inbox = Inbox(self.codec, self.workers, self.token)
        active = len(self.workers)
        while active:
            src, message = inbox.next()
            flags, clock, version, token = message.read_header()
            leaving = token != self.token or bool(flags & DONE)
            began = time.perf_counter()
            if leaving:
                if token != self.token:
                    self.refused += 1
                    self._reply(src, REFUSED)
                self.clocks[src] = GONE
                active -= 1
            else:
                if flags & PUSH:
                    self._apply(self.codec.decode(message.body), version)
                    self.clocks[src] = clock
                if flags & PULL:
                    self.pending.append((src, clock))
            inbox.release(src)
            self._answer()
            self.busy_seconds += time.perf_counter() - began
        for send, _ in self._sends.values():
            send.wait()
        return {"pushes_applied": self.pushes_applied, "updates": self.version, "refused": self.refused,
                "staleness": dict(sorted(self.staleness.items())),
                "read_staleness": dict(sorted(self.read_staleness.items())),
                "busy_seconds": self.busy_seconds,  # handling requests (wall clock)
                "cpu_seconds": time.process_time() - cpu}  # all threads, the receiving ones included

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
        self._sends[worker] = (dist.isend(message.buffer, worker, tag=REPLY), message)


class Inbox:
    """A receive posted for every worker's next request, each waited on by a thread of its own;
    `next()` returns requests in the order they complete, `release(src)` lets src's buffer be reused."""

    def __init__(self, codec: PushCodec, workers: list[int], token: int) -> None:
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()
        self.messages = {w: codec.message() for w in workers}
        self.free = {w: threading.Semaphore(0) for w in workers}
        self.token = token
        for w in workers:
            threading.Thread(target=self._receive, args=(w,), name=f"ps-inbox-{w}", daemon=True).start()

    def _receive(self, worker: int) -> None:
        message = self.messages[worker]
        while True:
            try:
                dist.irecv(message.buffer, worker, tag=REQUEST).wait()
            except Exception as error:  # a dead or hung worker: the server's loop raises it
                self.arrived.put((worker, error))
                return
            flags, _, _, token = message.read_header()
            self.arrived.put((worker, None))
            if flags & DONE or token != self.token:  # the worker's last request
                return
            self.free[worker].acquire()

    def next(self) -> tuple[int, Message]:
        worker, error = self.arrived.get()
        if error is not None:
            raise error
        return worker, self.messages[worker]

    def release(self, worker: int) -> None:
        self.free[worker].release()

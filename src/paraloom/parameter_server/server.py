"""One parameter server: owns a shard, answers pulls when the consistency rule allows, applies pushes.

Messages are c10d point-to-point (gloo over TCP; NCCL on GPUs): a worker sends a header
[kind, clock, version] (tag HEADER) and, with a push, the gradient shard (tag PAYLOAD); the
server answers a pull with [version] (tag REPLY_HEADER) and the parameter shard (tag REPLY).
The server receives headers from any source, one at a time, so its state needs no lock.

BSP sums the W pushes of a clock and takes one optimizer step with their mean — the update of
synchronous all-reduce SGD. ASP and SSP take a step per push, with the gradient divided by W
(so W pushes move the parameters as far as one BSP step). A push's staleness is the number of
updates the server applied between the worker's read and its push.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from paraloom.parameter_server.consistency import may_read

PULL, PUSH, DONE = 0, 1, 2
HEADER, PAYLOAD, REPLY_HEADER, REPLY = 11, 12, 13, 14


class ParameterServer:
    def __init__(self, shard: torch.Tensor, optimizer_factory, *, workers: list[int],
                 bound: int | None, average: bool) -> None:
        self.param = torch.nn.Parameter(shard.detach().clone())
        self.param.grad = torch.zeros_like(self.param)
        self.optimizer = optimizer_factory([self.param])
        self.workers = workers
        self.bound = bound
        self.average = average  # BSP: one step per clock with the mean of all pushes
        self.clocks = {w: 0 for w in workers}
        self.version = 0  # optimizer steps taken
        self.pending: list[tuple[int, int]] = []  # pulls (worker, clock) not yet allowed
        self.incoming = torch.zeros_like(self.param)
        self.summed = 0  # BSP: pushes summed into .grad for the current clock
        self.staleness: Counter[int] = Counter()  # per push: updates applied since its read
        self.read_staleness: Counter[int] = Counter()  # per read: reader's clock - slowest clock
        self.pushes_applied = 0
        self.busy_seconds = 0.0
        self._snapshot: tuple[int, torch.Tensor] | None = None
        self._sends: list[Any] = []

    def serve(self) -> dict[str, Any]:
        """Run until every worker has said it is done; returns this server's metrics."""
        header = torch.zeros(3, dtype=torch.int64)
        done = 0
        while done < len(self.workers):
            src = dist.recv(header, tag=HEADER)
            began = time.perf_counter()
            kind, clock, version = header.tolist()
            if kind == PUSH:
                dist.recv(self.incoming, src=src, tag=PAYLOAD)
                self._apply(version)
                self.clocks[src] = clock + 1
            elif kind == PULL:
                self.pending.append((src, clock))
            else:
                done += 1
                self.clocks[src] = 1 << 62  # a finished worker never holds the others back
            self._answer()
            self._sends = [w for w in self._sends if not w.is_completed()]
            self.busy_seconds += time.perf_counter() - began
        for work in self._sends:
            work.wait()
        return {"pushes_applied": self.pushes_applied, "updates": self.version,
                "staleness": dict(sorted(self.staleness.items())),
                "read_staleness": dict(sorted(self.read_staleness.items())),
                "busy_seconds": self.busy_seconds}

    @torch.no_grad()
    def _apply(self, version: int) -> None:
        self.staleness[self.version - version] += 1
        self.pushes_applied += 1
        n = len(self.workers)
        if self.average:
            self.param.grad.add_(self.incoming)
            self.summed += 1
            if self.summed < n:
                return
            self.param.grad.div_(n)
            self.summed = 0
        else:
            torch.div(self.incoming, n, out=self.param.grad)
        self.optimizer.step()
        self.param.grad.zero_()
        self.version += 1

    def _answer(self) -> None:
        still = []
        for worker, clock in self.pending:
            if not may_read(clock, self.clocks.values(), self.bound):
                still.append((worker, clock))
                continue
            self.read_staleness[max(0, clock - min(self.clocks.values()))] += 1
            if self._snapshot is None or self._snapshot[0] != self.version:
                # replies are sent asynchronously; later steps must not change what is on its way
                self._snapshot = (self.version, self.param.detach().clone())
            version, values = self._snapshot
            self._sends.append(dist.isend(torch.tensor([version], dtype=torch.int64), worker,
                                          tag=REPLY_HEADER))
            self._sends.append(dist.isend(values, worker, tag=REPLY))
        self.pending = still

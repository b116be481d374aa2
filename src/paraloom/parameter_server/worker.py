"""A parameter-server worker's side: push each slice's gradient with the request for its next read.

Each server's shard travels as one or more slices (shard.slice_layout), each a message of its
own. A step is one request and one reply per slice. `push()` sends every slice not sent yet:
the slice's gradient (compressed if so configured) and the read request for the next step,
after posting the reply's receive; `pull()` waits for every reply and loads it into the model.
The first `pull()`, before any push, sends read requests alone.

`attach(model)` overlaps communication with computation, slice by slice (P3, Jayarajan et al.
2019): a slice's request leaves during backward as soon as every parameter in it has its
gradient (the last layers' slices first), and a reply is loaded only when forward reaches the
first layer that needs it (the first layers' slices first) — so the next step's forward starts
once the first slice is back, not the last.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.errors import UserError
from paraloom.parameter_server.message import DONE, OK, PULL, PUSH, Message, PushCodec, reply_tag, request_tag
from paraloom.parameter_server.shard import flatten_model


class PSClient:
    """Talks to the servers: slice i of the flat model, `bounds[i]`, is owned by global rank
    `servers[i]` (a server owning several slices appears once for each, its slices in order)."""

    def __init__(self, model: nn.Module, servers: list[int], bounds: list[tuple[int, int]], *,
                 token: int = 0, codecs: list[PushCodec] | None = None) -> None:
        self.flat, self.flat_grad = flatten_model(model)
        self.servers, self.bounds = servers, bounds
        self.slots = [servers[:i].count(server) for i, server in enumerate(servers)]  # index at its server
        self.token = token
        self.codecs = codecs or [PushCodec(hi - lo) for lo, hi in bounds]
        self.requests = [codec.message() for codec in self.codecs]
        self.replies = [Message(hi - lo, torch.float32) for lo, hi in bounds]
        self.clock = 0  # gradients pushed
        self.versions = [0] * len(servers)  # server version of the slices last read
        self.wait_seconds = 0.0  # time spent waiting for replies (the consistency rule's price)
        self.pushes_sent = 0
        self.pushes_during_backward = 0  # attach(): slices sent before backward had finished
        self.wire_bytes = 0  # bytes of requests sent (headers and payloads)
        self.read_staleness: Counter[int] = Counter()  # own clock - slowest clock, per read
        self._receives: list[Any] = [None] * len(servers)  # a slice's reply on its way
        self._sends: list[list[Any]] = [[] for _ in servers]
        self._pushed = [False] * len(servers)  # this step's gradient of the slice has left
        self._hooks: list[Any] = []
        self._waiting: list[int] = []  # backward: parameters of each slice still without a gradient

    def pull(self, *, fresh: bool = False) -> None:
        """Wait for every slice's reply (requesting them first if no push did) and load them;
        `fresh`: then read once more, for the servers' state as it is now."""
        if fresh:
            self.pull()
        if fresh or all(work is None for work in self._receives):
            for i in range(len(self.servers)):
                self._request(i, PULL)
        for i in range(len(self.servers)):
            self._load(i)

    def push(self) -> None:
        """Send every slice's gradient not sent yet, each with the read request for the next step."""
        for i in range(len(self.servers)):
            if not self._pushed[i]:
                self._push(i)
        self.clock += 1
        self._pushed = [False] * len(self.servers)

    def close(self) -> None:
        """Tell every server this worker is done (after loading any reply still on its way)."""
        self.detach()
        self.settle()
        for i in range(len(self.servers)):
            self._request(i, DONE)
        for i in range(len(self.servers)):
            self._finish_sends(i)

    def settle(self) -> None:
        """Load every reply still on its way (and request nothing)."""
        for i in range(len(self.servers)):
            self._load(i)

    def attach(self, model: nn.Module) -> None:
        """Overlap: push a slice during backward once its gradients are complete; load a slice's
        reply when forward first needs it. The trainer then calls `push()` but not `pull()`."""
        offsets, offset = {}, 0
        for p in model.parameters():
            if p.requires_grad:
                offsets[p] = (offset, offset + p.numel())
                offset += p.numel()
        slices_of = {p: [i for i, (lo, hi) in enumerate(self.bounds) if lo < end and start < hi]
                     for p, (start, end) in offsets.items()}
        self._per_slice = [sum(i in slices for slices in slices_of.values()) for i in range(len(self.bounds))]
        self._waiting = list(self._per_slice)
        for p, slices in slices_of.items():
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda param, slices=slices: self._on_grad(slices)))
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in slices_of]
            needed = sorted({i for p in own for i in slices_of[p]})
            if needed:
                self._hooks.append(module.register_forward_pre_hook(
                    lambda mod, args, needed=needed: self._before_forward(needed)))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, slices: list[int]) -> None:
        for i in slices:
            self._waiting[i] -= 1
            if self._waiting[i] == 0 and not self._pushed[i]:
                self._push(i)
                self.pushes_during_backward += 1

    def _before_forward(self, slices: list[int]) -> None:
        for i in slices:
            self._load(i)

    def _push(self, i: int) -> None:
        self._finish_sends(i)
        lo, hi = self.bounds[i]
        self.codecs[i].encode(self.flat_grad[lo:hi], i, self.requests[i])
        self.flat_grad[lo:hi].zero_()  # the message holds the gradient now
        self._request(i, PUSH | PULL, clock=self.clock + 1)
        self._pushed[i] = True
        self.pushes_sent += 1
        if self._waiting:
            self._waiting[i] = self._per_slice[i]

    def _request(self, i: int, flags: int, clock: int | None = None) -> None:
        server, message = self.servers[i], self.requests[i]
        if flags & PULL:  # receive first: gloo stalls a sender whose data no receive awaits
            self._receives[i] = dist.irecv(self.replies[i].buffer, server, tag=reply_tag(self.slots[i]))
        message.write_header(flags, self.clock if clock is None else clock, self.versions[i], self.token)
        self._sends[i].append(dist.isend(message.buffer, server, tag=request_tag(self.slots[i])))
        self.wire_bytes += self.codecs[i].wire_bytes

    def _load(self, i: int) -> None:
        work = self._receives[i]
        if work is None:
            return
        began = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - began
        self._receives[i] = None
        reply = self.replies[i]
        version, status, slowest, _ = reply.read_header()
        if status != OK:
            raise UserError(f"parameter server rank {self.servers[i]} refused this worker: its run "
                            f"token {self.token} is not the server's (a worker of another run?)")
        self.versions[i] = version
        self.read_staleness[max(0, self.clock - slowest)] += 1
        lo, hi = self.bounds[i]
        with torch.no_grad():
            self.flat[lo:hi].copy_(reply.body)
        self._finish_sends(i)

    def _finish_sends(self, i: int) -> None:
        for work in self._sends[i]:
            work.wait()
        self._sends[i] = []

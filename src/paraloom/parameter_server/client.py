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

Each slice's gradient is checked for NaN and Inf before encoding (one reduction per slice); a
non-finite one is not encoded but sent flagged NONFINITE, and the server drops it.
`last_push_finite` tells the trainer whether the step's gradient was finite everywhere.
`mark_snapshot()` before backward makes the step's pushes SNAP pushes: the servers take a
consistent snapshot at the new clock before they answer; `state_dict()` taken then, with the
servers' snapshot, lets a fresh client and fresh servers resume exactly there.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.compress.state import load_state_of, state_dict_of
from paraloom.config.errors import UserError
from paraloom.optim.finite import is_finite
from paraloom.parameter_server.message import (
    DONE,
    NONFINITE,
    OK,
    PULL,
    PUSH,
    SNAP,
    Message,
    PushCodec,
    reply_tag,
    request_tag,
)
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
        self.last_push_finite = True  # the last step's gradient held no NaN or Inf in any slice
        self._finite = True  # ... so far in this step's pushes
        self._snap = False  # this step's pushes carry SNAP
        self._receives: list[Any] = [None] * len(servers)  # a slice's reply on its way
        self._sends: list[list[Any]] = [[] for _ in servers]
        self._pushed = [False] * len(servers)  # this step's gradient of the slice has left
        self._hooks: list[Any] = []
        self._holding = False  # see holding()
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
        self.last_push_finite, self._finite, self._snap = self._finite, True, False

    @torch.no_grad()
    def clip_grad(self, max_norm: float) -> None:
        """`clip_grad_norm_` on this step's whole gradient (before `push`): scaled by
        min(1, max_norm / (norm + 1e-6))."""
        self.flat_grad.mul_((max_norm / (self.flat_grad.norm() + 1e-6)).clamp(max=1.0))

    def mark_snapshot(self) -> None:
        """Make this step's pushes SNAP pushes: the servers snapshot their state at the clock they
        bring, before answering. Call it before backward, which may push slices (`attach()`)."""
        if any(self._pushed):
            raise RuntimeError("mark_snapshot() after some of this step's slices were pushed: call it "
                               "before backward, so that every slice of the step carries the mark")
        self._snap = True

    def state_dict(self) -> dict[str, Any]:
        """This worker's progress and every codec's compressor state (error-feedback memory and
        the like), as copies that load with `torch.load(weights_only=True)`; take it between steps."""
        if any(self._pushed):
            raise RuntimeError("state_dict() in the middle of a step's pushes: take it after push()")
        return {"clock": self.clock, "versions": list(self.versions), "pushes_sent": self.pushes_sent,
                "pushes_during_backward": self.pushes_during_backward, "wire_bytes": self.wire_bytes,
                "wait_seconds": self.wait_seconds,
                # copies: compressors update some of these tensors in place (DGC's momentum)
                "compressors": [None if c.compressor is None else copy.deepcopy(state_dict_of(c.compressor))
                                for c in self.codecs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output; on a client with nothing on its way (a fresh one):
        the next `pull()` then reads at the restored clock."""
        if any(work is not None for work in self._receives) or any(self._pushed):
            raise RuntimeError("load_state_dict() on a client with requests on their way; load it into a "
                               "fresh client, before its first pull()")
        compressors = state["compressors"]
        if len(state["versions"]) != len(self.servers) or len(compressors) != len(self.codecs):
            raise ValueError(f"the state is of {len(state['versions'])} slices; this client has "
                             f"{len(self.servers)}: load the state of a run with the same layout")
        for codec, saved in zip(self.codecs, compressors, strict=True):
            if (codec.compressor is None) != (saved is None):
                was = "uncompressed" if saved is None else "compressed"
                raise ValueError(f"the state's pushes were {was}; this client's are "
                                 f"{codec.name or 'uncompressed'}: resume with the same comm.compressor")
            if saved is not None:  # a copy: the compressor goes on updating what it is given
                load_state_of(codec.compressor, copy.deepcopy(saved))
        self.clock = int(state["clock"])
        self.versions = [int(v) for v in state["versions"]]
        self.pushes_sent = int(state["pushes_sent"])
        self.pushes_during_backward = int(state["pushes_during_backward"])
        self.wire_bytes = int(state["wire_bytes"])
        self.wait_seconds = float(state["wait_seconds"])

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

    @contextlib.contextmanager
    def holding(self):
        """Gradient accumulation: backward inside adds to the gradients and pushes nothing; the
        next backward outside pushes the sum as usual."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def _on_grad(self, slices: list[int]) -> None:
        if self._holding:
            return
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
        grad = self.flat_grad[lo:hi]
        flags = PUSH | PULL | (SNAP if self._snap else 0)
        if is_finite(grad):
            self.codecs[i].encode(grad, i, self.requests[i])
        else:  # not encoded: a compressor could hide a NaN, or keep it in its error feedback
            flags |= NONFINITE
            self._finite = False
        grad.zero_()  # the message holds the gradient now
        self._request(i, flags, clock=self.clock + 1)
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

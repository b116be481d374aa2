"""A parameter-server worker's side: pull every shard, compute, push every shard's gradient."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from paraloom.parameter_server.server import DONE, HEADER, PAYLOAD, PULL, PUSH, REPLY, REPLY_HEADER
from paraloom.parameter_server.shard import flatten_model


class PSClient:
    """Talks to the servers `servers` (global ranks), server i owning `bounds[i]` of the flat model."""

    def __init__(self, model: nn.Module, servers: list[int], bounds: list[tuple[int, int]]) -> None:
        self.flat, self.flat_grad = flatten_model(model)
        self.servers, self.bounds = servers, bounds
        self.clock = 0  # gradients pushed
        self.versions = [0] * len(servers)  # server version of the shards last pulled
        self.wait_seconds = 0.0  # time spent waiting for pulls (the consistency rule's price)
        self.pushes_sent = 0
        self._pushes: list = []

    def pull(self) -> None:
        """Fetch every shard (concurrently) into the model; blocks while the rule says wait."""
        self._finish_pushes()
        began = time.perf_counter()
        replies, headers = [], []
        for server, (lo, hi) in zip(self.servers, self.bounds, strict=True):
            version = torch.zeros(1, dtype=torch.int64)
            headers.append(version)
            replies.append(dist.irecv(version, server, tag=REPLY_HEADER))
            replies.append(dist.irecv(self.flat[lo:hi], server, tag=REPLY))
        for server in self.servers:
            dist.isend(torch.tensor([PULL, self.clock, 0], dtype=torch.int64), server, tag=HEADER).wait()
        for work in replies:
            work.wait()
        self.versions = [int(v) for v in headers]
        self.wait_seconds += time.perf_counter() - began

    def push(self) -> None:
        """Send every shard's gradient (concurrently); the gradients are zeroed before the next pull."""
        for i, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            header = torch.tensor([PUSH, self.clock, self.versions[i]], dtype=torch.int64)
            self._pushes.append(dist.isend(header, server, tag=HEADER))
            self._pushes.append(dist.isend(self.flat_grad[lo:hi], server, tag=PAYLOAD))
        self.clock += 1
        self.pushes_sent += len(self.servers)

    def _finish_pushes(self) -> None:
        for work in self._pushes:
            work.wait()
        self._pushes = []
        self.flat_grad.zero_()

    def close(self) -> None:
        self._finish_pushes()
        for server in self.servers:
            dist.isend(torch.tensor([DONE, self.clock, 0], dtype=torch.int64), server, tag=HEADER).wait()

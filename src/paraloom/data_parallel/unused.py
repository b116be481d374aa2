"""`find_unused_parameters=True` as DDP means it: a parameter no rank used keeps its gradient untouched.

Without the flag (and for a parameter some rank used) a missing gradient counts as zero in the
average. With it, the engine holds an `UnusedParameters` (`engine.unused`; None without the flag)
that notes which parameters got a gradient on this rank since the last synchronization
(`no_sync()` steps included) and, once the step's buckets are averaged, all-reduces that map (one
byte a parameter, after every bucket has landed, so it never interleaves with them); a parameter
that no rank used gets its gradient back as it was before backward, as DDP leaves it: `None` after
`optimizer.zero_grad()`, so optimizers that skip such parameters (Adam's moments, weight decay)
skip them as under DDP. Under `join()`, ranks that ran out of batches answer as DDP's do (`shadow`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


class UnusedParameters:
    """Which of the engine's parameters (`params`, its order) got a gradient, and since when."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.used: set[nn.Parameter] = set()  # got a gradient here since the last synchronization
        # whose gradient was None before this step's forward (at construction: before the buckets bind)
        self.none_before: set[nn.Parameter] = {p for p in params if p.grad is None}
        self.flags: torch.Tensor | None = None  # the last step's map of parameters some rank used

    def note_missing(self, params: Iterable[nn.Parameter]) -> None:
        """Before forward: these parameters' gradients are None (about to be bound to their buckets)."""
        self.none_before.update(p for p in params if p.grad is None)

    def used_map(self, device: torch.device) -> torch.Tensor:
        """One byte a parameter (`params` order): 1 where this rank produced a gradient."""
        used = self.used
        return torch.tensor([p in used for p in self.params], dtype=torch.uint8, device=device)

    def release(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """After the average: parameters no rank used get their gradient back as `None`."""
        flags, none_before = self.used_map(device), self.none_before
        self.used, self.none_before = set(), set()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        self.flags = flags  # what this rank answers with once it has joined (`shadow`)
        if bool(flags.all()):
            return
        for p, flag in zip(self.params, flags.tolist(), strict=True):
            if not flag and p in none_before:
                p.grad = None

    def shadow(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """A joined rank's part of `release`'s all-reduce. As DDP's joined ranks do, it answers with
        the map of its last synchronized step, all-reduced in place from then on: a parameter used
        there, or by any rank since it joined, counts as used (a zero gradient, not None)."""
        if self.flags is None:
            self.flags = torch.zeros(len(self.params), dtype=torch.uint8, device=device)
        dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=group)

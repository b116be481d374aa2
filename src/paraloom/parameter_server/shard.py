"""Parameters as one flat vector, cut into contiguous shards of nearly equal bytes, one per server,
and each shard into slices that travel as messages of their own (priority partitioning)."""

from __future__ import annotations

import torch
from torch import nn


def shard_bounds(n: int, servers: int) -> list[tuple[int, int]]:
    """[lo, hi) of each server's shard of n elements; sizes differ by at most one."""
    if servers < 1:
        raise ValueError("at least one server")
    cuts = [n * i // servers for i in range(servers + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def slice_layout(n: int, servers: int, slice_elements: int) -> list[tuple[int, int, int]]:
    """(server, lo, hi) of every slice, in the flat vector's order: each server's shard (as
    `shard_bounds` cuts it) cut into ceil(size / slice_elements) slices of nearly equal size."""
    if slice_elements < 1:
        raise ValueError("a slice holds at least one element")
    layout = []
    for server, (lo, hi) in enumerate(shard_bounds(n, servers)):
        parts = max(1, -(-(hi - lo) // slice_elements))
        layout += [(server, lo + a, lo + b) for a, b in shard_bounds(hi - lo, parts)]
    return layout


def flatten_model(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat parameters, flat gradients): every parameter and its `.grad` become views of the two,
    so pulls land in the model and pushes send the gradients without a copy."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat_grad = torch.zeros_like(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset: offset + n].view_as(p)
        p.grad = flat_grad[offset: offset + n].view_as(p)
        offset += n
    return flat, flat_grad

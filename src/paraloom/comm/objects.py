"""Numbers, strings and JSON between ranks, as tensors: nothing received is unpickled."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def broadcast_text(text: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Rank 0's string (or None) on every rank of `group` (collective)."""
    is_source = dist.get_rank(group) == 0
    data = text.encode() if is_source and text is not None else b""
    size = torch.tensor([-1 if is_source and text is None else len(data)], dtype=torch.int64)
    src = dist.get_global_rank(group or dist.group.WORLD, 0)
    dist.broadcast(size, src=src, group=group)
    if size.item() < 0:
        return None
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if is_source and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if size.item():
        dist.broadcast(buffer, src=src, group=group)
    return buffer.numpy().tobytes().decode()


def gather_json(data: Any | None, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-able value, those that gave one (not None), in rank order, on every rank."""
    raw = json.dumps(data).encode() if data is not None else b""
    size = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    mine = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in sizes]
    dist.all_gather(every, mine, group=group)
    return [json.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(every, sizes, strict=True) if int(n)]


def gather_floats(values: list[float], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `values` (the same count on each), one float64 row per rank in rank order."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every)

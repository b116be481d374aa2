"""Gradient buckets: parameters packed, in back-propagation order, into flat per-dtype buffers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


def assign_buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int,
                   first_bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices (given in back-propagation order) into buckets.

    A bucket closes once it holds at least its cap of bytes; the first one (the first gradients
    backward produces) has the smaller cap so communication starts early, as in DDP.
    Parameters of different dtypes never share a bucket.
    """
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for index, (nbytes, dtype) in enumerate(sizes):
        members, filled = open_by_dtype.get(dtype, ([], 0))
        members.append(index)
        filled += nbytes
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if filled >= cap:
            buckets.append(members)
            open_by_dtype.pop(dtype, None)
        else:
            open_by_dtype[dtype] = (members, filled)
    buckets += [members for members, _ in open_by_dtype.values()]
    return buckets


@dataclass
class Bucket:
    """A flat buffer whose slices are the `.grad` of its parameters."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0  # parameters whose gradient this backward has not produced yet
    seen: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, index: int, params: list[nn.Parameter]) -> Bucket:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(index, params, buffer, views)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def bind(self, slot: int) -> bool:
        """Make parameter `slot`'s gradient the bucket view; True if a gradient had to be copied in."""
        p, view = self.params[slot], self.views[slot]
        copied = False
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # e.g. after zero_grad(set_to_none=True)
            copied = True
        p.grad = view
        return copied

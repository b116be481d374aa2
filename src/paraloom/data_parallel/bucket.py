"""Gradient buckets: parameters packed, in back-propagation order, into flat per-dtype buffers,
and the pieces of them that collectives carry."""

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
    """A flat buffer whose slices are the `.grad` of its parameters.

    Updaters that average or shard parameters also keep the parameters themselves in a flat
    buffer of the same layout (`flatten_params`); OD-SGD keeps a second gradient buffer (`spare`)
    to reduce one step's gradients while the next step's accumulate.
    """

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    offsets: list[int]  # where each parameter starts in the buffer
    pending: int = 0  # parameters whose gradient this backward has not produced yet
    seen: set[int] = field(default_factory=set)
    param_buffer: torch.Tensor | None = None
    spare: torch.Tensor | None = None

    @classmethod
    def build(cls, index: int, params: list[nn.Parameter], *, pad_to: int = 1) -> Bucket:
        """Lay the parameters out back to back; the length is padded to a multiple of `pad_to`."""
        total = sum(p.numel() for p in params)
        total += -total % pad_to
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offsets, offset = [], 0
        for p in params:
            offsets.append(offset)
            offset += p.numel()
        return cls(index, params, buffer, _views(buffer, params, offsets), offsets)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def bind(self, slot: int) -> bool:
        """Make parameter `slot`'s gradient the bucket view; True if a gradient had to be copied in."""
        p, view = self.params[slot], self.views[slot]
        grad = p.grad
        if grad is view:  # autograd accumulated into the view: nothing to do
            return False
        copied = False
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # e.g. after zero_grad(set_to_none=True)
            copied = True
        p.grad = view
        return copied

    def bind_all(self) -> None:
        """Every gradient its bucket view; when all of them are None (after `zero_grad()`), the
        buffer is zeroed in one kernel instead of one per view."""
        if all(p.grad is None for p in self.params):
            self.buffer.zero_()
            for p, view in zip(self.params, self.views, strict=True):
                p.grad = view
        else:
            for slot in range(len(self.params)):
                self.bind(slot)

    def flatten_params(self) -> None:
        """Move the parameters' values into one flat buffer; each `p.data` becomes a view of it."""
        self.param_buffer = torch.zeros_like(self.buffer)
        for p, view in zip(self.params, _views(self.param_buffer, self.params, self.offsets), strict=True):
            view.copy_(p.data)
            p.data = view

    def param_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a buffer laid out like this bucket, one per parameter, shaped like it."""
        return _views(buffer, self.params, self.offsets)

    def swap_buffers(self) -> None:
        """Exchange the gradient buffer with the spare one and point every `.grad` at the new views."""
        if self.spare is None:
            self.spare = torch.zeros_like(self.buffer)
        self.buffer, self.spare = self.spare, self.buffer
        self.views = _views(self.buffer, self.params, self.offsets)
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view


def _views(buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> list[torch.Tensor]:
    return [_shaped_like(buffer[o: o + p.numel()], p) for p, o in zip(params, offsets, strict=True)]


def _shaped_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`flat` shaped as `p` with `p`'s strides where its memory is dense (channels_last, a
    transposed weight), as DDP lays its buckets out: autograd then accumulates straight into the
    view (a gradient's layout follows its parameter's), without a copy or torch's layout warning."""
    if p.is_contiguous() or not _dense(p):
        return flat.view_as(p)
    return flat.as_strided(p.shape, p.stride())


def _dense(p: torch.Tensor) -> bool:
    """Whether `p`'s elements fill exactly `p.numel()` places of memory in some order of its dims."""
    expected = 1
    for stride, size in sorted((p.stride(d), p.size(d)) for d in range(p.dim()) if p.size(d) > 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(eq=False)
class Piece:
    """What one collective carries: a slice [start, stop) of a bucket's gradient buffer."""

    key: int  # launch order before any reordering: bucket by bucket, front to back
    bucket: Bucket
    start: int
    stop: int

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.buffer[self.start: self.stop]

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.bucket.buffer.element_size()


def cut_pieces(buckets: list[Bucket], piece_bytes: int | None) -> list[list[Piece]]:
    """Split every bucket into pieces of at most `piece_bytes` (None: one piece per bucket)."""
    out, key = [], 0
    for bucket in buckets:
        n = bucket.buffer.numel()
        step = n if piece_bytes is None else max(1, piece_bytes // bucket.buffer.element_size())
        pieces = []
        for start in range(0, n, step):
            pieces.append(Piece(key, bucket, start, min(start + step, n)))
            key += 1
        out.append(pieces)
    return out

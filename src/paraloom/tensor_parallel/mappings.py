"""The f/g conjugate operators of Megatron tensor parallelism (Shoeybi et al. 2019) over one process group.

Each is an autograd function whose backward is the forward's conjugate collective. With a group of
one rank (or no process group at all) every operator is the identity. Collectives run on the calling
thread (forward and backward alike), so every rank of the group issues them in the same order.
Given a `timeline` (carried to backward in the autograd context), each collective records a span
on lane "tp" named after its operator and direction, e.g. "all_reduce g forward", while active.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from paraloom.trace.timeline import Timeline


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (None: the default group; 1 when torch.distributed is not initialized)."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group` (0 when torch.distributed is not initialized)."""
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor holding the reduction of `x` over `group`; `x` itself is left alone."""
    out = x.contiguous().clone()  # autograd may share one gradient buffer between two branches
    if group_size(group) > 1:
        dist.all_reduce(out, op=op, group=group)
    return out


def all_gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in group rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def timed(timeline: Timeline | None, name: str, collective: Callable[..., torch.Tensor],
          x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`collective(x, *args, **kwargs)`, recorded as span `name` on lane "tp" (with `bytes`: what
    this rank hands in) when `timeline` is given and active; otherwise just the call."""
    if timeline is None or not timeline.active:
        return collective(x, *args, **kwargs)
    start = timeline.now()
    out = collective(x, *args, **kwargs)
    timeline.span(name, "tp", start, timeline.now(), bytes=x.numel() * x.element_size())
    return out


def own_slice_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous share of the last dimension of `x`."""
    size = group_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} does not split evenly over {size} ranks")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """f of Shoeybi et al. 2019: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        ctx.group, ctx.timeline = group, timeline
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return timed(ctx.timeline, "all_reduce f backward", all_reduce, grad, ctx.group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g of Shoeybi et al. 2019: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        return timed(timeline, "all_reduce g forward", all_reduce, x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Split of Shoeybi et al. 2019: keep this rank's slice of the last dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        ctx.group, ctx.timeline = group, timeline
        return own_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return timed(ctx.timeline, "all_gather backward", all_gather_last, grad, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """Gather of Shoeybi et al. 2019: all-gather the last dim forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        ctx.group = group
        return timed(timeline, "all_gather forward", all_gather_last, x, group)

    @staticmethod
    def backward(ctx, grad):
        return own_slice_last(grad, ctx.group), None, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                   timeline: Timeline | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region (Shoeybi et al. 2019, f): identity; backward all-reduces."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, timeline)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                       timeline: Timeline | None = None) -> torch.Tensor:
    """Leave a tensor-parallel region (Shoeybi et al. 2019, g): all-reduce; backward is the identity."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, timeline)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                      timeline: Timeline | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim (Shoeybi et al. 2019); backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, timeline)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                       timeline: Timeline | None = None) -> torch.Tensor:
    """All-gather the last dim in rank order (Shoeybi et al. 2019); backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, timeline)

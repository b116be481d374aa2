"""The f/g conjugate operators of Megatron tensor parallelism (Shoeybi et al. 2019) over one process group,
and sequence parallelism's g / g-bar pair (Korthikanti et al. 2022) that replaces its all-reduces.

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


# torch 2.13 renamed the flat collectives; the old names remain for older versions
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_splits(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of a {tuple(x.shape)} tensor does not split evenly over {size} "
                         f"tensor-parallel ranks; make its size a multiple of {size}")


def all_gather_dim(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in group rank order (one all-gather)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * group_size(group), *front.shape[1:]))
    _all_gather_flat(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's contiguous share along `dim` of the sum of every rank's `x` (one reduce-scatter)."""
    size = group_size(group)
    _check_splits(x, dim, size)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    _reduce_scatter_flat(out, front, group=group)
    return out.movedim(0, dim)


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


def own_slice(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous share of dimension `dim` of `x`."""
    size = group_size(group)
    _check_splits(x, dim, size)
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


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
    """Split of Shoeybi et al. 2019: keep this rank's slice of a dimension forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, timeline, dim):
        ctx.group, ctx.timeline, ctx.dim = group, timeline, dim
        return own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        out = timed(ctx.timeline, "all_gather backward", all_gather_dim, grad, ctx.group, ctx.dim)
        return out, None, None, None


class _GatherFromRegion(torch.autograd.Function):
    """Gather of Shoeybi et al. 2019: all-gather a dimension forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, timeline, dim):
        ctx.group, ctx.dim = group, dim
        return timed(timeline, "all_gather forward", all_gather_dim, x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, ctx.group, ctx.dim), None, None, None


class _AllGatherToRegion(torch.autograd.Function):
    """g of Korthikanti et al. 2022: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group, timeline, dim):
        ctx.group, ctx.timeline, ctx.dim = group, timeline, dim
        return timed(timeline, "all_gather g forward", all_gather_dim, x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        out = timed(ctx.timeline, "reduce_scatter g backward", reduce_scatter_dim, grad, ctx.group, ctx.dim)
        return out, None, None, None


class _ReduceScatterFromRegion(torch.autograd.Function):
    """g-bar of Korthikanti et al. 2022: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, timeline, dim):
        ctx.group, ctx.timeline, ctx.dim = group, timeline, dim
        return timed(timeline, "reduce_scatter g-bar forward", reduce_scatter_dim, x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        out = timed(ctx.timeline, "all_gather g-bar backward", all_gather_dim, grad, ctx.group, ctx.dim)
        return out, None, None, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                   timeline: Timeline | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region (Shoeybi et al. 2019, f): identity; backward all-reduces."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, timeline)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                       timeline: Timeline | None = None) -> torch.Tensor:
    """Leave a tensor-parallel region (Shoeybi et al. 2019, g): all-reduce; backward is the identity."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, timeline)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                      timeline: Timeline | None = None, *, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of dimension `dim` (Shoeybi et al. 2019); backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, timeline, dim)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                       timeline: Timeline | None = None, *, dim: int = -1) -> torch.Tensor:
    """All-gather dimension `dim` in rank order (Shoeybi et al. 2019); backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, timeline, dim)


def all_gather_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                         timeline: Timeline | None = None, *, dim: int = 1) -> torch.Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one (Korthikanti et al. 2022, g): all-gather
    the sequence dimension `dim`; backward reduce-scatters the region's partial gradients along it."""
    return x if group_size(group) == 1 else _AllGatherToRegion.apply(x, group, timeline, dim)


def reduce_scatter_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                               timeline: Timeline | None = None, *, dim: int = 1) -> torch.Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one (Korthikanti et al. 2022, g-bar): sum
    the ranks' partial outputs, keeping this rank's share of the sequence dimension `dim`; backward
    all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterFromRegion.apply(x, group, timeline, dim)

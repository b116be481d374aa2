"""Gradient clipping by global norm (`optim.clip_norm`), over gradients spread across ranks.

Single-process `torch.nn.utils.clip_grad_norm_` computes the L2 norm of all gradients and scales
them by `max_norm / (norm + 1e-6)` when that is below 1. Here the gradients a rank applies may be
part of the model only: a block of a flat buffer (the sharded optimizer), a pipeline stage, a
tensor-parallel shard, a fully sharded DTensor's local shard. Each rank sums the squares of its
part, the sums are all-reduced over the ranks that together hold the model once (`group`), and
every rank scales its part by the same coefficient. A tensor that several ranks of `group` hold
whole (a layer norm replicated across a tensor-parallel group) is counted by one of them only
(`counted`). No host sync: the coefficient stays on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class GlobalNormClip:
    """Scale gradients so their global L2 norm is at most `max_norm`; `last_norm` keeps the norm."""

    def __init__(self, max_norm: float, *, group: dist.ProcessGroup | None = None,
                 counted: Callable[[torch.Tensor], bool] | None = None) -> None:
        self.max_norm, self.group, self.counted = float(max_norm), group, counted
        self.last_norm: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        """Clip the `.grad` of `params`; `group` (when given) replaces the one of the constructor:
        the ranks over which these gradients are partitioned."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        grads = [_local(p.grad) for p in params]
        group = group if group is not None else self.group
        mine = [_local(p.grad) for p in params if self.counted(p)] if self.counted is not None else grads
        sq = torch.stack(torch._foreach_norm(mine)).square().sum() if mine else grads[0].new_zeros(())
        sq = sq.to(torch.float32)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        norm = sq.sqrt()
        self.last_norm = norm
        coef = (self.max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a DTensor's local shard (fully sharded data parallelism, whose
    shards of one model are summed over `group`), any other tensor whole."""
    return grad.to_local() if isinstance(grad, DTensor) else grad

"""Replicas' parameters and buffers kept alike, as DDP keeps them: at wrap time and before forward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.collectives import broadcast_coalesced


@torch.no_grad()
def sync_states(module: nn.Module, group: dist.ProcessGroup | None, init_sync: bool,
                init_sync_buffers: bool) -> None:
    """At wrap time: every replica takes group rank 0's parameters (and buffers), as DDP's init_sync.

    Without init_sync nothing is broadcast, so the parameters must already be equal: they are
    checked (the elementwise maximum over ranks against the minimum) and a difference is refused
    with what to do, since training from different starting points silently diverges.
    """
    if dist.get_world_size(group) == 1:
        return
    params = [p.data for p in module.parameters()]
    buffers = list(module.buffers())
    if init_sync:
        broadcast_coalesced(params + (buffers if init_sync_buffers else []), group)
        return
    floats = [p for p in params if p.is_floating_point()]
    if not floats:
        return
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in floats])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(high, low):
        raise RuntimeError("the module's parameters differ across ranks at wrap time and init_sync=False "
                           "skips the broadcast from rank 0: seed the model alike on every rank "
                           "(torch.manual_seed before building it), or leave init_sync=True")


def sync_buffers(module: nn.Module, group: dist.ProcessGroup | None, src: int = 0) -> None:
    """Before a forward: every replica takes group rank `src`'s buffers (BatchNorm's running statistics)."""
    buffers = list(module.buffers())
    if buffers:
        broadcast_coalesced(buffers, group, src)

"""`find_unused_parameters=True` as DDP means it: a parameter no rank used keeps its gradient untouched.

Without the flag (and for a parameter some rank used) a missing gradient counts as zero in the
average. With it, the engine notes which parameters got a gradient on this rank since the last
synchronization (`no_sync()` steps included) and, once the step's buckets are averaged, all-reduces
that map (one byte a parameter, after every bucket has landed, so it never interleaves with them);
a parameter that no rank used gets its gradient back as it was before backward, as DDP leaves it:
`None` after `optimizer.zero_grad()`, so optimizers that skip such parameters (Adam's moments,
weight decay) skip them as under DDP. Under `join()`, ranks that ran out of batches answer as
DDP's do (`shadow_unused`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def used_map(engine) -> torch.Tensor:
    """One byte a parameter (engine.params order): 1 where this rank produced a gradient."""
    used = engine._used
    return torch.tensor([p in used for p in engine.params], dtype=torch.uint8, device=engine.join_device)


def release_unused(engine) -> None:
    """After the average: parameters no rank used get their gradient back as `None`."""
    flags, none_before = used_map(engine), engine._none_before
    engine._used, engine._none_before = set(), set()
    if engine.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=engine.group)
    engine._used_flags = flags  # what this rank answers with once it has joined (`shadow_unused`)
    if bool(flags.all()):
        return
    for p, flag in zip(engine.params, flags.tolist(), strict=True):
        if not flag and p in none_before:
            p.grad = None


def shadow_unused(engine) -> None:
    """A joined rank's part of `release_unused`'s all-reduce. As DDP's joined ranks do, it answers
    with the map of its last synchronized step, all-reduced in place from then on: a parameter used
    there, or by any rank since it joined, counts as used (a zero gradient, not None)."""
    if engine._used_flags is None:
        engine._used_flags = torch.zeros(len(engine.params), dtype=torch.uint8, device=engine.join_device)
    dist.all_reduce(engine._used_flags, op=dist.ReduceOp.MAX, group=engine.group)

"""Uneven inputs under `torch.distributed.algorithms.join.Join`: a rank out of batches shadows the others.

DataParallel is a `Joinable`, as DDP is: `with model.join(): <the training loop>` (or
`Join([model, ...])`) lets ranks run different numbers of steps. While it runs, every training
forward on a rank that still has batches issues, on the data-parallel group and in this order:
the context's own "not joined yet" all-reduce (`Join.notify_join_context`), an all-reduce of 1 if
this forward's backward will synchronize (0 under `no_sync()` or without grad; `announce`), and,
when buffers are synced before forward, an all-reduce-max that picks the highest rank still
training as their source (a joined rank's buffers are stale) and the buffers' broadcast from it.
Backward then all-reduces every bucket in the one launch order of the engine.

A joined rank answers each of those (`EngineJoinHook.main_hook`): it takes part in the same
all-reduces, and when the others synchronize it runs the engine's own launch path on zeroed
gradients, so compressors and comm hooks issue the same collectives they issue elsewhere; its own
gradients are put back afterwards, as DDP leaves a joined rank's. When
every rank has joined, the last one to join (the highest rank among them) broadcasts its
parameters and buffers to all (`post_hook`), as DDP does. Gradients are averaged over the whole
group by default (joined ranks add zeros); with `divide_by_initial_world_size=False`, over the
ranks still training, which the all-reduce of `announce` counts.

Only the synchronous updater follows this protocol: the others (priority, one-step delay, local
SGD, the sharded optimizer) communicate outside backward, and `join_hook` refuses them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from paraloom.comm.collectives import broadcast_coalesced
from paraloom.data_parallel.states import sync_buffers


def check_joinable(engine) -> None:
    """Refuse, in one line, an engine whose step communicates outside the backward pass."""
    if not engine.updater.plain_optimizer_step or engine.auto is not None:
        setting = "comm.scheduler=auto" if engine.auto is not None else type(engine.updater).__name__
        raise ValueError(f"join() shadows the synchronous all-reduce of backward only; {setting} "
                         "communicates outside it: use comm.sync=sync with scheduler fifo or wait_free, "
                         "or give every rank the same number of batches")
    if engine.guard_group is not None:
        raise ValueError("join() cannot shadow the non-finite guard's per-step flag; train with "
                         "optimizer.step() (the guard on the averaged gradients) or even inputs")


def _flag(engine, value: float) -> torch.Tensor:
    return torch.full((1,), value, device=engine.join_device)




def buffer_source(engine, candidate: bool) -> int:
    """The group rank buffers (or the final model) come from: the highest `candidate` rank."""
    rank = _flag(engine, float(engine.rank if candidate else -1))
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=engine.group)
    return int(rank.item())


def sync_buffers_joined(engine, training: bool) -> None:
    """Before a forward under join: every replica takes the buffers of the highest rank still training."""
    if any(True for _ in engine.module.buffers()):
        sync_buffers(engine.module, engine.group, buffer_source(engine, training))


class JoinRun:
    """The engine's state under an enabled `join()` (`engine.join_run`): what this step's gradients
    are divided by, and the count of ranks that synchronize it."""

    def __init__(self) -> None:
        self.divide_by_world = True  # join(divide_by_initial_world_size=...)
        self.count: tuple[dist.Work, torch.Tensor] | None = None  # this step's `announce`, inside join()

    def begin(self, divide_by_initial_world_size: bool) -> None:
        self.divide_by_world = divide_by_initial_world_size

    def announce(self, engine) -> None:
        """On a rank still training, before forward: whether its backward will synchronize (async)."""
        count = _flag(engine, float(torch.is_grad_enabled() and engine.require_backward_grad_sync))
        self.count = dist.all_reduce(count, group=engine.group, async_op=True), count

    def divisor(self, world_size: int) -> int:
        """What the summed gradients are divided by: the group's size, or the ranks still training."""
        if self.count is None or self.divide_by_world:
            return world_size
        work, count = self.count
        work.wait()
        return max(1, int(count.item()))

    def end(self) -> None:
        self.count = None


class EngineJoinHook(JoinHook):
    """What a joined rank runs while others train (`main_hook`) and once all have joined (`post_hook`)."""

    def __init__(self, engine, divide_by_initial_world_size: bool = True) -> None:
        check_joinable(engine)
        self.engine = engine
        engine.join_run.begin(divide_by_initial_world_size)

    @torch.no_grad()
    def main_hook(self) -> None:
        engine = self.engine
        count = _flag(engine, 0.0)
        dist.all_reduce(count, group=engine.group)
        synced = bool(count.item())
        if engine.require_forward_param_sync and engine.forward_sync_buffers:
            sync_buffers_joined(engine, training=False)
        engine.require_forward_param_sync = synced
        if synced:
            self._shadow_backward()

    def _shadow_backward(self) -> None:
        """The engine's launch path on zeroed gradients: every bucket, in the engine's launch order.

        The rank's own gradients come back as they were (`None` stays `None`), as under DDP, whose
        joined ranks reduce zeroed copies: an optimizer joined beside the model (ZeroRedundancyOptimizer)
        then steps on what DDP would leave it."""
        engine = self.engine
        kept = [bucket.buffer.clone() for bucket in engine.buckets]
        engine.reset_buckets()
        for bucket in engine.buckets:
            bucket.buffer.zero_()
            bucket.pending = 0
            engine.bucket_ready(bucket)
        engine.executor.wait_all(engine.n_pieces)
        engine.reset_comm()
        if engine.unused is not None:  # the others' map of parameters some rank used (unused.py)
            engine.unused.shadow(engine.group, engine.join_device)
        for bucket, values in zip(engine.buckets, kept, strict=True):
            bucket.buffer.copy_(values)

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        engine = self.engine
        source = buffer_source(engine, is_last_joiner)
        tensors = [p.data for p in engine.module.parameters()]
        if engine.forward_sync_buffers:
            tensors += list(engine.module.buffers())
        broadcast_coalesced(tensors, engine.group, source)
        # torch's Joinable attribute, under torch's name; every rank runs this
        engine._join_config = _JoinConfig.construct_disabled_join_config()
        engine.join_run.end()

"""An engine's communication layout for one scheduler: policy, executor, group, buckets, pieces, updater.

`build_layout` is the one place that turns a scheduler (and a bucket size) into these structures,
reading what the scheduler needs from its class (comm/schedulers.py): a group of its own
(`own_group`), a credit window (`credit_window`), partitions instead of buckets (`cuts_pieces`),
deferred per-module updates (`defers_updates`, data_parallel/updaters.py). The engine holds the
result as `engine.layout`, built once at construction and again through `engine.relayout()` when
comm.scheduler=auto moves between its candidates (data_parallel/auto.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from paraloom.comm.collectives import private_group
from paraloom.comm.executor import CreditExecutor, Executor
from paraloom.comm.schedulers import SCHEDULERS, make_scheduler
from paraloom.data_parallel.bucket import Bucket, Piece, assign_buckets, cut_pieces
from paraloom.data_parallel.synchronous import SyncUpdater
from paraloom.data_parallel.updaters import make_updater

MB = 2**20


@dataclass(eq=False)
class CommLayout:
    """What one scheduler's communication is laid out as; the engine's `buckets`, `pieces`, `updater`,
    ... read it. `updater` is made last (updaters read the buckets), by `build_layout`."""

    scheduler: str  # comm.scheduler's name
    policy: object  # the policy object (comm/policies.py, comm/priority.py)
    executor: Executor  # runs the policy: one step's tasks launched and waited for
    comm_group: dist.ProcessGroup | None  # where the gradients' collectives go
    bucket_mb: float  # comm.bucket_mb this layout was built with (unused where the scheduler cuts pieces)
    buckets: list[Bucket]  # flat gradient buffers, in back-propagation order
    pieces: list[list[Piece]]  # per bucket: what each collective carries (the bucket, or partitions)
    n_pieces: int  # collectives a step launches
    slot: dict[nn.Parameter, tuple[Bucket, int]]  # parameter -> (its bucket, its index there)
    updater: SyncUpdater | None = None  # what engine.step() does (data_parallel/updaters.py)
    hooks: list = field(default_factory=list)  # the updater's hooks, removed with the layout

    def close(self) -> None:
        """Stop the executor and remove the updater's hooks (between steps, nothing in flight)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.executor.close()


def build_layout(engine, scheduler: str, bucket_mb: float) -> CommLayout:
    """Policy, executor, buckets, pieces and updater for `scheduler` at `bucket_mb`, over the
    engine's parameters and options (`engine.comm_options`): at construction, and again when
    comm.scheduler=auto moves on (between steps, nothing in flight, the last layout closed)."""
    o, params, needs = engine.comm_options, engine.params, SCHEDULERS[scheduler]
    policy = make_scheduler(scheduler)
    comm_group = engine.group
    if needs.own_group:  # its collectives can never interleave differently with the caller's
        comm_group = engine.private_comm_group()
        if o["compressor"] == "powersgd":  # its second rounds are issued by the waiting thread
            engine.compressor.second_group = private_group(engine.group)
    executor = CreditExecutor(policy, int(o["credit_mb"] * MB)) if needs.credit_window else Executor(policy)
    caps = (bucket_mb, o["first_bucket_mb"])
    if needs.cuts_pieces:  # small tensors merge up to a partition; large ones are cut
        caps = (o["partition_mb"], o["partition_mb"])
    groups = assign_buckets([(p.numel() * p.element_size(), p.dtype) for p in params],
                            int(caps[0] * MB), int(caps[1] * MB))
    pad_to = engine.world_size if o["shard_optimizer"] else 1
    buckets = [Bucket.build(i, [params[j] for j in members], pad_to=pad_to)
               for i, members in enumerate(groups)]
    pieces = cut_pieces(buckets, int(o["partition_mb"] * MB) if needs.cuts_pieces else None)
    slot = {}
    for bucket in buckets:
        for index, p in enumerate(bucket.params):
            slot[p] = (bucket, index)
            bucket.bind(index)
    layout = CommLayout(scheduler, policy, executor, comm_group, bucket_mb, buckets, pieces,
                        sum(len(p) for p in pieces), slot)
    keys = ("sync", "shard_optimizer", "local_steps", "local_warmup", "credit_mb", "delay_lr")
    layout.updater = make_updater(engine, layout, deferred=needs.defers_updates, **{k: o[k] for k in keys})
    if not layout.updater.plain_optimizer_step:
        layout.hooks.append(register_optimizer_step_pre_hook(engine.refuse_plain_step))
    if layout.updater.lands_on_read:  # deferred updates land before anyone reads the state dict
        layout.hooks.append(engine.module.register_state_dict_pre_hook(lambda *_: engine.finish()))
    return layout

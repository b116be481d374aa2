"""Which updater an engine gets: comm.sync, the priority scheduler and optimizer sharding decide.

Each updater lives in a module of its own and subclasses data_parallel/synchronous.py's
`SyncUpdater`; this module is the one place that knows them all.
"""

from __future__ import annotations

from paraloom.data_parallel.deferred_updates import PriorityUpdater
from paraloom.data_parallel.delayed import DelayedUpdater
from paraloom.data_parallel.local_sgd import LocalSGDUpdater
from paraloom.data_parallel.sharded_optimizer import ShardedUpdater
from paraloom.data_parallel.synchronous import SyncUpdater

MB = 2**20


def make_updater(engine, *, sync: str, scheduler: str, shard_optimizer: bool, local_steps: int,
                 local_warmup: int, credit_mb: float, delay_lr: float | None) -> SyncUpdater:
    """The updater for options that `paraloom.config.rules.check_dp_options` has accepted."""
    if shard_optimizer:
        return ShardedUpdater(engine)
    if sync == "one_step_delay":
        return DelayedUpdater(engine, lr=delay_lr)
    if sync == "local_sgd":
        return LocalSGDUpdater(engine, local_steps=local_steps, warmup=local_warmup)
    if scheduler == "priority":
        return PriorityUpdater(engine, credit_bytes=int(credit_mb * MB))
    return SyncUpdater(engine)

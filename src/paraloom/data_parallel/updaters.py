"""Which updater an engine gets: comm.sync, the scheduler's deferred updates and optimizer sharding decide.

Each updater lives in a module of its own and subclasses data_parallel/synchronous.py's
`SyncUpdater`; this module is the one place that knows them all. Updaters that lay their own
state out like the gradient buckets read them from the layout being built (data_parallel/layout.py).
"""

from __future__ import annotations

from paraloom.data_parallel.deferred_updates import PriorityUpdater
from paraloom.data_parallel.delayed import DelayedUpdater
from paraloom.data_parallel.local_sgd import LocalSGDUpdater
from paraloom.data_parallel.sharded_optimizer import ShardedUpdater
from paraloom.data_parallel.synchronous import SyncUpdater

MB = 2**20


def make_updater(engine, layout, *, sync: str, deferred: bool, shard_optimizer: bool, local_steps: int,
                 local_warmup: int, credit_mb: float, delay_lr: float | None) -> SyncUpdater:
    """The updater for options that `paraloom.config.rules.check_dp_options` has accepted; `deferred`:
    the scheduler defers each module's update to its next forward (its `defers_updates`)."""
    if shard_optimizer:
        return ShardedUpdater(engine, layout)
    if sync == "one_step_delay":
        return DelayedUpdater(engine, layout, lr=delay_lr)
    if sync == "local_sgd":
        return LocalSGDUpdater(engine, layout, local_steps=local_steps, warmup=local_warmup)
    if deferred:
        return PriorityUpdater(engine, layout, credit_bytes=int(credit_mb * MB))
    return SyncUpdater(engine)

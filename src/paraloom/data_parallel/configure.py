"""An engine's scheduling structures for one scheduler: policy, executor, buckets, pieces, updater.

Built once at construction, and again when comm.scheduler=auto settles (data_parallel/auto.py):
priority cuts gradients into partitions and defers updates, fifo and wait_free share buckets.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_pre_hook

from paraloom.comm.collectives import private_group
from paraloom.comm.executor import CreditExecutor, Executor
from paraloom.comm.schedulers import make_scheduler
from paraloom.data_parallel.bucket import Bucket, assign_buckets, cut_pieces
from paraloom.data_parallel.updaters import make_updater

MB = 2**20


def configure(engine, scheduler: str) -> None:
    """Policy, executor, buckets, pieces and updater for `scheduler`: at construction, and again
    when comm.scheduler=auto settles on one (between steps, nothing in flight)."""
    o, module = engine._options, engine.module
    engine.scheduler = scheduler
    engine.policy = make_scheduler(scheduler)
    if engine._executor is not None:
        engine._executor.close()
    engine.comm_group = engine.group
    if scheduler == "priority":
        # launch times follow each rank's own progress, so the engine's collectives get a
        # group of their own: they can never interleave differently with the caller's
        engine._private = engine._private or engine._given_comm_group or private_group(engine.group)
        engine.comm_group = engine._private
        if o["compressor"] == "powersgd":  # its second rounds are issued by the waiting thread
            engine.compressor.second_group = private_group(engine.group)
        engine._executor = CreditExecutor(engine.policy, int(o["credit_mb"] * MB))
    else:
        engine._executor = Executor(engine.policy)
    params = engine.params
    caps = (o["bucket_mb"], o["first_bucket_mb"])
    if scheduler == "priority":  # small tensors merge up to a partition; large ones are cut
        caps = (o["partition_mb"], o["partition_mb"])
    groups = assign_buckets([(p.numel() * p.element_size(), p.dtype) for p in params],
                            int(caps[0] * MB), int(caps[1] * MB))
    pad_to = engine.world_size if o["shard_optimizer"] else 1
    engine.buckets = [Bucket.build(i, [params[j] for j in members], pad_to=pad_to)
                      for i, members in enumerate(groups)]
    piece_mb = o["partition_mb"] if scheduler == "priority" else None
    engine.pieces = cut_pieces(engine.buckets, int(piece_mb * MB) if piece_mb else None)
    engine.n_pieces = sum(len(p) for p in engine.pieces)
    engine._slot = {}
    for bucket in engine.buckets:
        for slot, p in enumerate(bucket.params):
            engine._slot[p] = (bucket, slot)
            bucket.bind(slot)
    for hook in engine._updater_hooks:  # the last updater's, a priority updater's forward pre-hooks too
        hook.remove()
    engine._updater_hooks = []
    keys = ("sync", "shard_optimizer", "local_steps", "local_warmup", "credit_mb", "delay_lr")
    engine.updater = make_updater(engine, scheduler=scheduler, **{k: o[k] for k in keys})
    if not engine.updater.plain_optimizer_step:
        engine._updater_hooks.append(register_optimizer_step_pre_hook(engine._refuse_plain_step))
    if engine.updater.lands_on_read:  # deferred updates land before anyone reads the state dict
        engine._updater_hooks.append(module.register_state_dict_pre_hook(lambda *_: engine.finish()))
    engine._reset()

"""Sync modes of DataParallel: what `engine.step(optimizer)` does after backward; the synchronous one.

A mode owns the step: which collective a ready gradient piece launches (`launch`), how the
parameters are updated (`step`), what must complete before the model is read (`finish`), and
whether the classic `sync_gradients(); optimizer.step()` loop is allowed (`check_classic`).
"""

from __future__ import annotations

from paraloom.errors import UserError

SYNC_NAMES = ("sync", "one_step_delay", "local_sgd")


class _Completed:
    """The handle of a collective that needs no communication (one rank): already done."""

    @staticmethod
    def wait() -> None:
        return None

    @staticmethod
    def is_completed() -> bool:
        return True


DONE = _Completed()


class SyncMode:
    """Synchronous data parallelism: average gradients, then one optimizer step on every rank."""

    # After `sync_gradients` every rank holds the same averaged gradients, and a NaN or Inf on any
    # rank is in them (NaN + x = NaN, Inf + finite = Inf, Inf - Inf = NaN): the non-finite guard can
    # check those locally instead of all-reducing a flag. Modes that update from anything else say no.
    guards_on_sums = True

    def __init__(self, engine) -> None:
        self.engine = engine

    def launch(self, piece, on_done=None):
        if self.engine.compressor is not None:
            from paraloom.data_parallel.compressed import launch_compressed

            return launch_compressed(self.engine, piece, on_done)
        return self.engine.all_reduce_async(piece.grad, self.engine.piece_name(piece), on_done)

    def after_forward(self) -> None:
        pass

    def check_classic(self) -> None:
        pass

    def step(self, optimizer) -> None:
        self.engine.sync_gradients()
        optimizer.step()
        self.engine.zero_grad()

    def step_if_finite(self, optimizer) -> bool:
        """`step`, unless the averaged gradients hold NaN or Inf: then no update, on every rank alike."""
        self.engine.sync_gradients()
        finite = self.engine.gradients_finite()
        if finite:
            optimizer.step()
        self.engine.zero_grad()
        return finite

    def finish(self) -> None:
        pass

    # ---- checkpoints: a mode's state between steps, without changing what later steps compute

    replicas_identical = True  # parameters and optimizer state equal on every rank between steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")


def make_mode(engine, *, sync: str, scheduler: str, shard_optimizer: bool, local_steps: int,
              local_warmup: int, credit_mb: float, delay_lr: float | None):
    check_mode(sync=sync, scheduler=scheduler, shard_optimizer=shard_optimizer, algorithm=engine.algorithm,
               local_steps=local_steps, local_warmup=local_warmup, credit_mb=credit_mb)
    if shard_optimizer:
        from paraloom.data_parallel.shard import ShardedMode

        return ShardedMode(engine)
    if sync == "one_step_delay":
        from paraloom.data_parallel.delayed import DelayedMode

        return DelayedMode(engine, lr=delay_lr)
    if sync == "local_sgd":
        from paraloom.data_parallel.local_sgd import LocalSGDMode

        return LocalSGDMode(engine, local_steps=local_steps, warmup=local_warmup)
    if scheduler == "priority":
        from paraloom.data_parallel.priority import PriorityMode

        return PriorityMode(engine, credit_bytes=int(credit_mb * 2**20))
    return SyncMode(engine)


def check_mode(*, sync: str, scheduler: str, shard_optimizer: bool, algorithm: str, local_steps: int,
               local_warmup: int, credit_mb: float, compressor: str | None = None) -> None:
    """Refuse combinations that are not built, with the reason, before any process group work."""
    if sync not in SYNC_NAMES:
        raise UserError(f"comm.sync={sync!r} is not known; choose one of: {', '.join(SYNC_NAMES)}")
    if local_steps < 1 or local_warmup < 0:
        raise UserError("comm.local_steps must be at least 1 and comm.local_warmup not negative")
    if credit_mb <= 0:
        raise UserError(f"comm.credit_mb={credit_mb} must be positive")
    if shard_optimizer and sync != "sync":
        raise UserError(f"comm.shard_optimizer=true works with comm.sync=sync only, not {sync!r}")
    if shard_optimizer and algorithm not in ("native", "ring"):
        raise UserError(f"comm.shard_optimizer=true reduce-scatters with algorithm native or ring, "
                        f"not {algorithm!r}")
    if compressor not in (None, "none") and (shard_optimizer or sync == "one_step_delay"):
        raise UserError(f"comm.compressor={compressor} compresses the gradient all-reduce of comm.sync=sync "
                        "or local_sgd's warm-up; not with one_step_delay or shard_optimizer")
    if compressor == "powersgd" and scheduler == "priority" and algorithm != "native":
        raise UserError("comm.compressor=powersgd with comm.scheduler=priority needs comm.algorithm=native: "
                        "its two rounds come from two threads, which one comm thread would serialize "
                        "differently on different ranks")
    if scheduler == "priority" and (sync != "sync" or shard_optimizer):
        raise UserError("comm.scheduler=priority works with comm.sync=sync and no optimizer sharding: "
                        "its deferred updates replace the synchronous step")

"""The synchronous updater, base of every DataParallel updater: what `engine.step(optimizer)` does.

An updater owns the step: which collective a ready gradient piece launches (`launch`), how the
parameters are updated (`step`), what must complete before the model is read (`finish`), and
whether the classic `sync_gradients(); optimizer.step()` loop is allowed (`check_classic`).
Which updater an engine gets (comm.sync, the priority scheduler, optimizer sharding) is decided
in data_parallel/updaters.py.
"""

from __future__ import annotations

from paraloom.data_parallel.comm_hook import launch_hooked
from paraloom.data_parallel.compressed import launch_compressed


class _Completed:
    """The handle of a collective that needs no communication (one rank): already done."""

    @staticmethod
    def wait() -> None:
        return None

    @staticmethod
    def is_completed() -> bool:
        return True


DONE = _Completed()


class SyncUpdater:
    """Synchronous data parallelism: average gradients, then one optimizer step on every rank."""

    # After `sync_gradients` every rank holds the same averaged gradients, and a NaN or Inf on any
    # rank is in them (NaN + x = NaN, Inf + finite = Inf, Inf - Inf = NaN): the non-finite guard can
    # check those locally instead of all-reducing a flag. Updaters that update from anything else say no.
    guards_on_sums = True
    # The update is a plain optimizer step on the averaged gradients: the engine averages them at
    # the end of backward and the user's `optimizer.step()` may apply them. Updaters that update
    # otherwise say no, and a plain step is refused (DistributedOptimizer drives them).
    plain_optimizer_step = True
    # Whether `finish()` is local (no collective of its own) and must run before the wrapped
    # module's state dict is read: the priority scheduler's deferred per-module updates.
    lands_on_read = False

    def __init__(self, engine) -> None:
        self.engine = engine

    def launch(self, piece, on_done=None):
        if self.engine.comm_hook is not None:
            return launch_hooked(self.engine, piece, on_done)
        if self.engine.compressor is not None:
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

    # ---- checkpoints: an updater's state between steps, without changing what later steps compute

    replicas_identical = True  # parameters and optimizer state equal on every rank between steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")

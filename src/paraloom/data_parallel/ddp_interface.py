"""The parts of DataParallel that make it a drop-in for DDP: no_sync, join, comm hooks, the optimizer's step.

Mixed into `engine.DataParallel`; kept apart so the engine module holds the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from paraloom.data_parallel import join
from paraloom.data_parallel.comm_hook import check_hook
from paraloom.data_parallel.states import sync_buffers


class DDPInterface:
    """What DDP does around the engine: buffers synced and gradients re-bound before forward,
    `no_sync()`, `join()` (uneven inputs), `register_comm_hook()`, and the guard that refuses a plain
    `optimizer.step()` where the engine's updater owns the update."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next synced step reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """DDP's context manager for uneven inputs: ranks that run out of batches shadow the others'
        collectives until all have; then the last to finish broadcasts its model (`data_parallel/join.py`)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> join.EngineJoinHook:
        return join.EngineJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    # DDP's attributes that scripts and libraries read or set, under DDP's names
    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside `no_sync()`; setting it False is `no_sync()` until it is set back, as in DDP."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @property
    def process_group(self):
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @property
    def find_unused_parameters(self) -> bool:
        return self.find_unused

    @property
    def join_device(self) -> torch.device:
        return self.buckets[0].buffer.device if self.buckets else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.group

    # the engine's own work around forward stays eager under torch.compile (a graph break each)
    @torch.compiler.disable
    def _pre_forward(self) -> None:
        joining = self._join_config.enable
        if joining:  # inside an enabled Join: tell the ranks that ran out of batches what comes
            Join.notify_join_context(self)
            self.join_run.announce(self)
        if self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1:
            if joining:
                join.sync_buffers_joined(self, training=True)
            else:
                sync_buffers(self.module, self.group)  # as DDP: rank 0's buffers before a training forward
        if torch.is_grad_enabled():
            self._bind_missing_grads()

    @torch.compiler.disable
    def _post_forward(self) -> None:
        self.require_forward_param_sync = torch.is_grad_enabled() and self._sync
        self.updater.after_forward()
        self.forward_done_at = time.perf_counter()

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._launched_in_backward = self.layout.executor.launched
        try:
            self.sync_gradients()
        except RuntimeError as exc:  # DDP without join() hangs here; say what most likely happened
            raise RuntimeError(sync_failure(exc)) from exc

    @property
    def launched_in_backward(self) -> int:
        """Collectives launched while the last backward ran, before the end-of-backward wait."""
        return self._launched_in_backward if self._synced else self.layout.executor.launched

    @torch.no_grad()
    def _bind_missing_grads(self) -> None:
        """Gradients set to None (`optimizer.zero_grad()`'s default) become zeroed bucket views again
        before backward, so autograd accumulates straight into the buckets: no copy per step."""
        unused = self.unused
        for bucket in self.layout.buckets:
            if any(p.grad is None for p in bucket.params):
                if unused is not None:
                    unused.note_missing(bucket.params)
                bucket.bind_all()

    def refuse_plain_step(self, optimizer: torch.optim.Optimizer, *_) -> None:
        """An optimizer step pre-hook (the layout registers it): under updaters that own the update,
        only the engine steps."""
        slot = self.layout.slot
        if self._stepping or not any(p in slot for g in optimizer.param_groups for p in g["params"]):
            return
        raise RuntimeError(f"{type(self.updater).__name__} applies the update itself, so a plain "
                           "optimizer.step() would skip it: wrap the optimizer, "
                           "`optimizer = paraloom.DistributedOptimizer(optimizer, model)`, "
                           "or call `model.step(optimizer)`")

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """While the engine (or its updater) drives the optimizer: its step() is allowed."""
        self._stepping += 1
        try:
            yield
        finally:
            self._stepping -= 1

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's interface: `hook(state, bucket) -> Future[Tensor]` averages each gradient bucket
        instead of the engine's all-reduce (torch's default hooks and `paraloom.compress.ddp_hook`)."""
        check_hook(self, hook)
        self.comm_hook = (state, hook)


PEER_GONE = ("connection reset", "connection closed", "connection refused", "broken pipe", "end of file")


def sync_failure(exc: BaseException) -> str:
    """What a failed end-of-backward all-reduce most likely means: a peer that died closes its
    connections at once (the backend says so); one that waits past the timeout may have run out of
    batches (uneven inputs) or hang."""
    said = " ".join(str(exc).split())
    if any(word in said.lower() for word in PEER_GONE):
        return (f"the gradient all-reduce did not complete: a peer rank died (its connection closed). "
                f"The backend said: {said}")
    return ("the gradient all-reduce did not complete: another rank stopped taking part. If the ranks' "
            "inputs are uneven, train inside `with model.join():` or give every rank the same number of "
            "batches (e.g. DistributedSampler(..., drop_last=True)); otherwise a rank failed or hangs. "
            f"The backend said: {said}")

"""One-step-delay SGD (OD-SGD, Xu et al. 2019): step t's all-reduce overlaps step t+1's forward and backward.

Each rank keeps two copies of the parameters. The global copy W_g advances with the averaged
gradients, one step late: at the end of step t it takes the optimizer step with the average of
step t-1's gradients, whose all-reduce ran while step t computed. The model computes with the
local copy, which OD-SGD's local compensation sets to W_g - lr * g_t, the global weights moved
by this rank's own newest gradient. Then step t's gradients are launched and the next step
accumulates into a second gradient buffer. `finish()` waits for the last all-reduce, applies it
and sets the model to W_g.
"""

from __future__ import annotations

import torch

from paraloom.data_parallel.synchronous import DONE, SyncUpdater


class DelayedUpdater(SyncUpdater):
    guards_on_sums = False  # see SyncUpdater: it does not update from this step's averaged gradients
    plain_optimizer_step = False  # see SyncUpdater: DistributedOptimizer (or engine.step) drives it

    def __init__(self, engine, layout, *, lr: float | None) -> None:
        super().__init__(engine)
        self.lr = lr  # local compensation step; None: the optimizer's learning rate
        engine.reduce_in_backward = False  # gradients go out after the step, all at once
        self.global_params = []
        for bucket in layout.buckets:
            bucket.flatten_params()
            self.global_params.append(bucket.param_buffer.clone())
        self.in_flight: list = []  # (bucket, buffer being reduced, work) of the last step
        self.optimizer: torch.optim.Optimizer | None = None

    def check_classic(self) -> None:
        raise RuntimeError("comm.sync=one_step_delay updates in engine.step(optimizer); "
                           "sync_gradients() does not apply")

    def _apply_global(self) -> None:
        """Wait for the last step's averaged gradients and take the optimizer step on W_g with them."""
        engine, world = self.engine, self.engine.world_size
        for _bucket, buffer, work in self.in_flight:
            work.wait()
            if world > 1:
                buffer.div_(world)
        for (bucket, buffer, _), global_buffer in zip(self.in_flight, self.global_params, strict=True):
            for p, value, grad in zip(bucket.params, bucket.param_views(global_buffer),
                                      bucket.param_views(buffer), strict=True):
                p.data, p.grad = value, grad
        try:
            self.optimizer.step()
        finally:
            for bucket in engine.buckets:
                for p, value, grad in zip(bucket.params, bucket.param_views(bucket.param_buffer),
                                          bucket.views, strict=True):
                    p.data, p.grad = value, grad
        for _bucket, buffer, _work in self.in_flight:
            buffer.zero_()
        self.in_flight = []

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        engine = self.engine
        self.optimizer = optimizer
        if self.in_flight:
            self._apply_global()
        lrs = {g["lr"] for g in optimizer.param_groups}
        if self.lr is None and len(lrs) > 1:
            raise RuntimeError("one_step_delay with several learning rates needs comm.delay_lr")
        lr = self.lr if self.lr is not None else lrs.pop()
        for bucket, global_buffer in zip(engine.buckets, self.global_params, strict=True):
            torch.add(global_buffer, bucket.buffer, alpha=-lr, out=bucket.param_buffer)  # W_l = W_g - lr g_t
        for bucket in engine.buckets:
            name = f"bucket {bucket.index} (delayed)"
            work = (engine.all_reduce_async(bucket.buffer, name) if engine.world_size > 1
                    else DONE)
            self.in_flight.append((bucket, bucket.buffer, work))
            bucket.swap_buffers()  # the next step accumulates into the other (zeroed) buffer

    replicas_identical = False  # the model holds W_l, moved by this rank's own gradient

    @torch.no_grad()
    def state_dict(self) -> dict:
        """W_g and the summed gradients of the last step (waited for, not yet applied)."""
        for _bucket, _buffer, work in self.in_flight:
            work.wait()
        return {"global": list(self.global_params),
                "in_flight": [buffer for _bucket, buffer, _work in self.in_flight]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for global_buffer, saved in zip(self.global_params, state["global"], strict=True):
            global_buffer.copy_(saved)
        self.in_flight = [(bucket, saved.clone(), DONE)
                          for bucket, saved in zip(self.engine.buckets, state["in_flight"], strict=False)]

    @torch.no_grad()
    def land(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the pending averaged step to W_g with `optimizer` and set the model to W_g (a resume on
        another number of ranks: no rank's own compensation carries over)."""
        self.optimizer = optimizer
        self.finish()
        for bucket, global_buffer in zip(self.engine.buckets, self.global_params, strict=True):
            bucket.param_buffer.copy_(global_buffer)

    @torch.no_grad()
    def finish(self) -> None:
        if self.in_flight:
            self._apply_global()
            for bucket, global_buffer in zip(self.engine.buckets, self.global_params, strict=True):
                bucket.param_buffer.copy_(global_buffer)

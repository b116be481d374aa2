"""Local SGD (post-local SGD, Lin et al. 2020): local steps, parameters averaged every H steps.

The first `warmup` steps are synchronous (gradients averaged every step, as in plain data
parallelism); after that each rank steps on its own gradients and every `local_steps`-th step
ends with an all-reduce of the parameters, bucket by bucket. Optimizer state (momentum, Adam's
moments) stays local, as in post-local SGD. `finish()` averages once more if local steps were
taken since the last averaging, so every rank ends with the same model.
"""

from __future__ import annotations

import torch

from paraloom.data_parallel.synchronous import SyncUpdater


class LocalSGDUpdater(SyncUpdater):
    guards_on_sums = False  # see SyncUpdater: it does not update from this step's averaged gradients
    plain_optimizer_step = False  # see SyncUpdater: DistributedOptimizer (or engine.step) drives it

    def __init__(self, engine, layout, *, local_steps: int, warmup: int) -> None:
        super().__init__(engine)
        self.local_steps = local_steps
        self.warmup = warmup
        self.steps = 0
        self.unaveraged = False  # local steps taken since the parameters were last averaged
        for bucket in layout.buckets:
            bucket.flatten_params()
        engine.reduce_in_backward = warmup > 0

    def check_classic(self) -> None:
        if self.steps >= self.warmup:
            raise RuntimeError("comm.sync=local_sgd updates in engine.step(optimizer); "
                               "sync_gradients() does not apply after the warm-up")

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        engine = self.engine
        if self.steps < self.warmup:
            super().step(optimizer)
        else:
            optimizer.step()
            engine.zero_grad()
            self.unaveraged = True
            if (self.steps - self.warmup + 1) % self.local_steps == 0:
                self.average_parameters()
        self.steps += 1
        engine.reduce_in_backward = self.steps < self.warmup

    replicas_identical = False  # local steps make the replicas (and their optimizers) differ

    def state_dict(self) -> dict:
        return {"steps": self.steps, "unaveraged": self.unaveraged}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.unaveraged = int(state["steps"]), bool(state["unaveraged"])
        self.engine.reduce_in_backward = self.steps < self.warmup

    @torch.no_grad()
    def finish(self) -> None:
        if self.unaveraged:
            self.average_parameters()

    def average_parameters(self) -> None:
        engine = self.engine
        self.unaveraged = False
        if engine.world_size == 1:
            return
        works = []
        for bucket in engine.buckets:
            works.append(engine.all_reduce_async(bucket.param_buffer, f"bucket {bucket.index} (params)"))
        for bucket, work in zip(engine.buckets, works, strict=True):
            work.wait()
            bucket.param_buffer.div_(engine.world_size)

"""Deferred per-module updates (priority scheduler): a module's next forward waits for its own parameters.

`step(optimizer)` launches what is left and returns at once. Just before a module's next
forward (a forward pre-hook), the pieces holding its parameters' gradients are waited for and
averaged, and the optimizer steps those parameters alone; so the first layers, whose partitions
the planned order sends first, start computing while the last layers' partitions are still on
the wire. Step 1 is profiled (when each piece was ready, launched and done; see
comm/priority.py) and, once all of it has landed, turned into the order later steps launch in.
"""

from __future__ import annotations

import torch
from torch import nn

from paraloom.comm.priority import PlanTask, busy_seconds, plan_order
from paraloom.data_parallel.synchronous import SyncUpdater

PROFILED_STEP = 1  # step 0 warms up allocators and caches; step 1 is timed; step 2 onwards planned


class PriorityUpdater(SyncUpdater):
    guards_on_sums = False  # see SyncUpdater: it does not update from this step's averaged gradients
    plain_optimizer_step = False  # see SyncUpdater: DistributedOptimizer (or engine.step) drives it
    lands_on_read = True  # the last step's updates are pending until the next forward or a read

    def __init__(self, engine, layout, *, credit_bytes: int) -> None:
        super().__init__(engine)
        self.credit_bytes = credit_bytes
        self.steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.lrs: list[float] = []
        self.pending: set[nn.Parameter] = set()
        self.averaged: set[int] = set()  # piece keys waited for and averaged in this step
        self.forward_rank: dict[nn.Parameter, int] = {}  # order of first use in forward
        self.pieces_of: dict[nn.Parameter, list] = {}
        self.slot_of: dict[nn.Parameter, tuple] = {}  # (bucket, slot): where its averaged gradient lands
        for bucket, pieces in zip(layout.buckets, layout.pieces, strict=True):
            for slot, (p, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                self.pieces_of[p] = [q for q in pieces if q.start < offset + p.numel() and q.stop > offset]
                self.slot_of[p] = (bucket, slot)
        self.modules = [m for m in engine.module.modules()
                        if m is engine.module or any(True for _ in m.parameters(recurse=False))]
        # a module whose forward never runs (nn.MultiheadAttention reads out_proj.weight itself) has
        # its parameters applied with the first enclosing module that does run
        self.ran: set[nn.Module] = set()
        for module in self.modules:
            # removed with the layout when comm.scheduler=auto moves on (engine.relayout), or at close
            layout.hooks.append(module.register_forward_pre_hook(self._before_forward))

    @torch.compiler.disable  # waits and optimizer steps: eager, also inside a compiled module
    def _before_forward(self, module: nn.Module, _args) -> None:
        self.ran.add(module)
        own = [p for m in module.modules() if m is module or m not in self.ran
               for p in m.parameters(recurse=False) if p.requires_grad]
        for p in own:
            self.forward_rank.setdefault(p, len(self.forward_rank))
        if self.pending:
            self.apply([p for p in own if p in self.pending])

    def after_forward(self) -> None:
        if self.pending:  # modules this forward did not run
            self.apply(list(self.pending))
        if self.steps == PROFILED_STEP + 1 and self.engine.policy.order is None:
            self._plan()  # the profiled step has fully landed and the next backward has not begun

    def check_classic(self) -> None:
        if self.pending:
            raise RuntimeError("updates of the last engine.step() are still pending; call engine.finish() "
                               "before switching to sync_gradients()")

    @torch.no_grad()
    def apply(self, params: list[nn.Parameter]) -> None:
        """Wait for and average the pieces of `params`, then step and zero those parameters."""
        if not params:
            return
        engine = self.engine
        # waited for in key order, the same on every rank (`params` may come from a set), since a
        # wait can issue a collective (PowerSGD's second round)
        pieces = {piece.key: piece for p in params for piece in self.pieces_of[p]}
        for key in sorted(pieces.keys() - self.averaged):
            engine.executor.wait(key)
            if engine.world_size > 1:
                pieces[key].grad.div_(engine.world_size)
            self.averaged.add(key)
        for p in params:
            # the step's averaged gradient is in the bucket whatever became of `.grad` since
            # engine.step() (Lightning's zero_grad(set_to_none=True) before validating): the update that
            # step committed to is applied from there
            bucket, slot = self.slot_of[p]
            if p.grad is not bucket.views[slot]:
                p.grad = bucket.views[slot]
        with engine.stepping():
            step_some(self.optimizer, params, self.lrs)
        for p in params:
            p.grad.zero_()
        self.pending.difference_update(params)
        if not self.pending:
            self.averaged.clear()
            engine.executor.reset()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        engine = self.engine
        if self.pending:
            raise RuntimeError("engine.step() ran twice without a forward in between")
        engine.complete_missing()
        engine.executor.flush(engine.n_pieces)
        self.optimizer = optimizer
        self.lrs = [g["lr"] for g in optimizer.param_groups]  # as of this step, for the deferred update
        self.pending = {p for bucket in engine.buckets for p in bucket.params}
        engine.reset_buckets()
        self.steps += 1
        if self.steps == PROFILED_STEP:
            engine.piece_times = {}  # the next step's launches are timed

    def _plan(self) -> None:
        """Turn the profiled step into the launch order: rank 0's timings, so every rank agrees."""
        engine = self.engine
        pieces = [q for qs in engine.pieces for q in qs]
        busy = busy_seconds([tuple(t) for t in engine.piece_times.values()])
        measured = torch.tensor([busy, *(engine.ready_at[q.key] for q in pieces)], dtype=torch.float64)
        if engine.world_size > 1:
            torch.distributed.broadcast(measured, src=torch.distributed.get_global_rank(
                engine.group or torch.distributed.group.WORLD, 0), group=engine.group)
        unused = len(self.forward_rank)  # parameters no forward used go last
        priority = {q.key: unused for q in pieces}
        for p, covering in self.pieces_of.items():
            for q in covering:
                priority[q.key] = min(priority[q.key], self.forward_rank.get(p, unused))
        tasks = [PlanTask(q.key, q.nbytes, priority[q.key], float(measured[1 + i]))
                 for i, q in enumerate(pieces)]
        seconds_per_byte = float(measured[0]) / sum(q.nbytes for q in pieces)
        engine.policy.order = plan_order(tasks, seconds_per_byte, self.credit_bytes)
        engine.piece_times = None
        self.plan = {"busy_seconds": float(measured[0]), "order": engine.policy.order}

    def finish(self) -> None:
        if self.pending:
            self.apply(list(self.pending))

    def state_dict(self) -> dict:
        """Deferred updates are applied now: elementwise, they give what the next forward would."""
        self.finish()
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        # The launch plan rests on one step's timings, which are not saved: a resumed run times a
        # step again and plans anew (the order moves launches, never values). Resuming past the
        # profiled step without this planned from timings that were never taken (a crash).
        self.steps = min(int(state["steps"]), PROFILED_STEP - 1)


def step_some(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], lrs: list[float]) -> None:
    """`optimizer.step()` for `params` only, at learning rates `lrs` (one per param group).

    Optimizers keep their state per parameter and update elementwise, so stepping a subset
    gives the same values as a whole step would for those parameters.
    """
    wanted = set(params)
    saved = [(g["params"], g["lr"]) for g in optimizer.param_groups]
    try:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["params"] = [p for p in g["params"] if p in wanted]
            g["lr"] = lr
        optimizer.step()
    finally:
        for g, (ps, lr) in zip(optimizer.param_groups, saved, strict=True):
            g["params"], g["lr"] = ps, lr

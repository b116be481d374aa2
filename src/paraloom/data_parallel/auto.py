"""comm.scheduler=auto: each scheduler tried for a few steps of this very run, the fastest kept.

Which scheduler is fastest depends on the model, the link and the cores: on loopback, where
gloo's reductions share the cores with backward, overlapping buys nothing and fifo wins; on a
link as slow as a step's compute, priority hides the transfer behind the next forward; on a
slower one still, wait_free. The overlap model (perfmodel/overlap.py) leaves out the cores
that communication and computation share, so the engine measures instead: `WARMUP` untimed and
`STEPS` timed steps each of wait_free, fifo and priority (priority rebuilds the buckets as its
partitions), the median step of each taken as the slowest rank's (one small all-reduce), and
the fastest kept for the rest of the run. Every rank switches at the same step. The steps are
the caller's own training steps, exact synchronous SGD under any of the three: only their speed
differs. The choice and the gain it measured are printed once, on rank 0, and kept in `chosen`.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from paraloom.data_parallel.configure import configure

CANDIDATES = ("wait_free", "fifo", "priority")  # the engine starts with the first
WARMUP, STEPS = 2, 5  # per candidate: steps after a switch left untimed (and one more), then timed
TRIAL_STEPS = len(CANDIDATES) * (WARMUP + 1 + STEPS)  # steps before the choice, which the last makes


class AutoScheduler:
    """Times the engine's steps under each candidate, then settles on the fastest."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.index, self.count, self.last = 0, 0, None
        self.times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
        self.chosen: dict | None = None  # {"scheduler", "seconds": {candidate: median step}}

    def after_step(self) -> None:
        """At the end of every engine step (rank by rank, the same step on all)."""
        if self.chosen is not None:
            return
        now = time.perf_counter()
        if self.last is not None and self.count > WARMUP:
            self.times[CANDIDATES[self.index]].append(now - self.last)
        self.count += 1
        self.last = now
        if self.count < WARMUP + STEPS + 1:
            return
        self.index, self.count, self.last = self.index + 1, 0, None
        if self.index < len(CANDIDATES):
            self._switch(CANDIDATES[self.index])
        else:
            self._settle()

    def _settle(self) -> None:
        medians = torch.tensor([statistics.median(self.times[name]) for name in CANDIDATES],
                               dtype=torch.float64)
        engine = self.engine
        if engine.world_size > 1:  # the slowest rank's: every rank then picks the same
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=engine.group)
        seconds = dict(zip(CANDIDATES, medians.tolist(), strict=True))
        best = min(CANDIDATES, key=seconds.get)
        self.chosen = {"scheduler": best, "seconds": seconds}
        if best != engine.scheduler:
            self._switch(best)
        if engine.rank == 0:
            others = ", ".join(f"{n} {seconds[n] * 1e3:.1f}" for n in CANDIDATES if n != best)
            gain = seconds["wait_free"] / seconds[best] - 1
            print(f"paraloom: comm.scheduler=auto chose {best}: {seconds[best] * 1e3:.1f} ms a step "
                  f"({others} ms; {STEPS} steps each), {gain:.1%} faster than wait_free", file=sys.stderr)

    def _switch(self, scheduler: str) -> None:
        """Land whatever is pending (priority defers updates), then rebuild for `scheduler`."""
        engine = self.engine
        engine.finish()
        configure(engine, scheduler)
        if engine._guard_asked is not None:
            engine.guard_nonfinite(*engine._guard_asked)

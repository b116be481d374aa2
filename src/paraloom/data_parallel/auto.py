"""comm.scheduler=auto and comm.bucket_mb=auto: each candidate tried for a few steps of this very
run, the fastest kept.

Which scheduler is fastest depends on the model, the link and the cores: on loopback, where
gloo's reductions share the cores with backward, overlapping buys nothing and fifo wins; on a
link as slow as a step's compute, priority hides the transfer behind the next forward; on a
slower one still, wait_free. The overlap model (perfmodel/cost/overlap.py) leaves out the cores
that communication and computation share, so the engine measures instead: blocks of `WARMUP`
untimed and `STEPS` timed steps of wait_free, fifo and priority in turn, `ROUNDS` blocks each
(priority rebuilds the buckets as its partitions), the median step of each taken as the slowest
rank's (one small all-reduce), and the fastest kept for the rest of the run -- unless it beats the
phase's first candidate (the default: wait_free, or the bucket size given) by no more than
`MARGIN`: where the candidates tie, a few timed steps differ by more than that from noise alone
(on 4 emulated 1 Gbit/s nodes, wait_free's trials measured 519-552 ms from run to run and fifo's
4% below to 8% above wait_free's of the same run, where 50 steps of each, fresh, put them within
1%), so leaving the default takes a clear gain. With comm.bucket_mb=auto, the bucket size is
tried next the same way, under the scheduler kept
(unless it is priority, which cuts partitions of comm.partition_mb instead): the first phase's
25 MB against the sizes of `BUCKET_SIZES` that group this model's gradients differently. Every
rank switches at the same step. The steps are the caller's own training steps, exact synchronous
SGD under any candidate: only their speed differs. The choice and the gain it measured are
printed once, on rank 0, and kept in `chosen`.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from paraloom.comm.schedulers import SCHEDULERS
from paraloom.config.choices import AUTO_START_BUCKET_MB, BUCKET_SIZES_MB
from paraloom.data_parallel.bucket import assign_buckets
from paraloom.data_parallel.layout import MB

CANDIDATES = ("wait_free", "fifo", "priority")  # the engine starts with the first
BUCKET_SIZES, START_BUCKET_MB = BUCKET_SIZES_MB, AUTO_START_BUCKET_MB
# a block: steps after a switch left untimed (and one more), then timed; every candidate gets
# ROUNDS blocks, taking turns, so that no candidate alone is timed on the run's first, coldest
# steps or on a stretch where the machine is busier (one block of 5 timed steps each, in a row,
# ran 4.5% over the best fixed scheduler on loopback in one run of benchmarks/dp_schedulers.py).
# Four rounds, 12 timed steps each: with two (6 steps), loopback's trials put fifo anywhere from 19%
# faster to 10% slower than wait_free where whole runs measured it 8% faster, and auto kept
# wait_free in 3 rounds of 5 (BENCHMARKS.md, issue 28's auto runs)
WARMUP, STEPS, ROUNDS = 1, 3, 4
BLOCK = WARMUP + 1 + STEPS
MARGIN = 0.02  # how much faster than the phase's first candidate another must be to replace it


def fastest(seconds: dict, margin: float = MARGIN):
    """The key of the smallest time, unless it is within `margin` of the first key's: then the
    first (the default stays where the trials cannot tell the candidates apart)."""
    first, best = next(iter(seconds)), min(seconds, key=seconds.get)
    return best if seconds[best] < seconds[first] * (1 - margin) else first


def trial_steps(candidates: int) -> int:
    """Steps a phase of trials takes for this many candidates."""
    return (ROUNDS if candidates > 1 else 1) * candidates * BLOCK


TRIAL_STEPS = trial_steps(len(CANDIDATES))  # steps before the scheduler's choice


class AutoScheduler:
    """Times the engine's steps under each candidate (scheduler, bucket MB), then settles on the
    fastest: first among `schedulers` at the engine's bucket size, then, with `buckets`, among the
    bucket sizes under the scheduler kept. Candidates take turns (`ROUNDS` blocks each), so a
    machine that slows down or warms up over the trials weighs on all of them alike."""

    def __init__(self, engine, bucket_mb: float, *, schedulers: tuple[str, ...] = CANDIDATES,
                 buckets: bool = False) -> None:
        self.engine, self.buckets = engine, buckets
        self._begin([(name, bucket_mb) for name in schedulers])
        self.scheduler: str | None = None  # kept after the first phase
        self.chosen: dict | None = None  # {"scheduler", "seconds": {scheduler: median step}, ...}

    def _begin(self, trials: list[tuple[str, float]]) -> None:
        """A phase: every trial's block in turn, `ROUNDS` times over (one block if there is one)."""
        self.trials, self.order = trials, trials * (ROUNDS if len(trials) > 1 else 1)
        self.times: dict[tuple[str, float], list[float]] = {trial: [] for trial in trials}
        self.index, self.count, self.last = 0, 0, None

    def start(self) -> str:
        """The scheduler the engine starts with (the first trial's)."""
        return self.trials[0][0]

    def after_step(self) -> None:
        """At the end of every engine step (rank by rank, the same step on all)."""
        if self.chosen is not None:
            return
        now = time.perf_counter()
        if self.last is not None and self.count > WARMUP:
            self.times[self.order[self.index]].append(now - self.last)
        self.count += 1
        self.last = now
        if self.count < BLOCK:
            return
        self.index, self.count, self.last = self.index + 1, 0, None
        if self.index < len(self.order):
            self._switch(*self.order[self.index])
        elif self.scheduler is None:
            self._settle_scheduler()
        else:
            self._settle_bucket()

    def _slowest_medians(self, trials: list[tuple[str, float]]) -> list[float]:
        medians = torch.tensor([statistics.median(self.times[t]) for t in trials], dtype=torch.float64)
        if self.engine.world_size > 1:  # the slowest rank's: every rank then picks the same
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.engine.group)
        return medians.tolist()

    def _settle_scheduler(self) -> None:
        trials = list(self.trials)
        seconds = dict(zip((name for name, _ in trials), self._slowest_medians(trials), strict=True))
        best = fastest(seconds)
        self.scheduler, self.seconds = best, seconds
        size, cuts_pieces = self.engine.layout.bucket_mb, SCHEDULERS[best].cuts_pieces
        sizes = self._distinct_sizes(size) if self.buckets and not cuts_pieces else []
        if sizes:  # the bucket sizes next, under the scheduler kept, the first phase's size among them
            self._begin([(best, mb) for mb in (size, *sizes)])
            self._switch(*self.order[0])
            return
        self._settle(best, None if cuts_pieces else size, {})

    def _settle_bucket(self) -> None:
        medians = dict(zip((mb for _, mb in self.trials), self._slowest_medians(self.trials), strict=True))
        best = fastest(medians)
        self._settle(self.scheduler, best, medians)

    def _settle(self, scheduler: str, bucket_mb: float | None, bucket_seconds: dict[float, float]) -> None:
        engine, seconds = self.engine, self.seconds
        self.chosen = {"scheduler": scheduler, "seconds": seconds}
        if self.buckets:
            self.chosen.update(bucket_mb=bucket_mb, bucket_seconds=bucket_seconds)
        if (scheduler, bucket_mb) != (engine.scheduler, engine.layout.bucket_mb):
            self._switch(scheduler, bucket_mb if bucket_mb is not None else engine.layout.bucket_mb)
        if engine.rank == 0:
            print(f"paraloom: {self._summary()}", file=sys.stderr)

    def _summary(self) -> str:
        chosen, seconds = self.chosen, self.seconds
        best = chosen["scheduler"]
        if len(seconds) > 1:
            others = ", ".join(f"{n} {seconds[n] * 1e3:.1f}" for n in seconds if n != best)
            gain = seconds.get("wait_free", seconds[best]) / seconds[best] - 1
            text = (f"comm.scheduler=auto chose {best}: {seconds[best] * 1e3:.1f} ms a step ({others} ms; "
                    f"{ROUNDS * STEPS} steps each), {gain:.1%} faster than wait_free")
        else:
            text = f"comm.scheduler={best}"
        if self.buckets:
            sizes = chosen["bucket_seconds"]
            if chosen["bucket_mb"] is None:
                text += f"; comm.bucket_mb=auto: {best} cuts partitions of comm.partition_mb instead"
            elif sizes:
                tried = ", ".join(f"{mb:g} MB {t * 1e3:.1f}" for mb, t in sizes.items())
                text += f"; comm.bucket_mb=auto chose {chosen['bucket_mb']:g} MB ({tried} ms a step)"
            else:
                text += f"; comm.bucket_mb=auto: every size groups this model as {chosen['bucket_mb']:g} MB"
        return text

    def _distinct_sizes(self, start: float) -> list[float]:
        """The sizes of BUCKET_SIZES that cut this model's gradients into other buckets than `start`
        (and than each other)."""
        engine = self.engine
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in engine.params]
        first = int(engine.comm_options["first_bucket_mb"] * MB)
        seen = {str(assign_buckets(sizes, int(start * MB), first))}
        kept = []
        for mb in BUCKET_SIZES:
            grouping = str(assign_buckets(sizes, int(mb * MB), first))
            if grouping not in seen:
                seen.add(grouping)
                kept.append(mb)
        return kept

    def _switch(self, scheduler: str, bucket_mb: float) -> None:
        """The engine's layout rebuilt for `scheduler` and `bucket_mb` (`engine.relayout` lands what
        is pending first: priority defers updates)."""
        self.engine.relayout(scheduler, bucket_mb)

"""Fault injection for tests and benchmarks: `kill`, `hang`, `nan` and `slow` at a rank and step.

    --inject kill:rank=1,step=30        the rank SIGKILLs itself as step 30 begins
    --inject hang:rank=2,step=10        the rank stops answering (sleeps) as step 10 begins
    --inject nan:rank=0,step=5          the rank's gradients of step 5 are NaN
    --inject slow:rank=1,factor=2.0     a persistent straggler: every step of rank 1 takes 2x
    --inject slow:rank=random,factor=2  a transient one: each step one rank, drawn from a seeded
                                        stream all ranks agree on, takes 2x
    --inject slow_data:rank=1,factor=2  a persistent input straggler: rank 1's every batch arrives
                                        1x a step's computation late (its step takes 2x)
    --inject lose:node=3,step=20        on a cluster (run.nodes=MIN..MAX): node 3's agent and
                                        workers are SIGKILLed as step 20 begins, the node lost for
                                        good; `back=S` starts it again S seconds after
                                        the others went on without it

A slow step's extra time is slept between forward and backward (`stretch`), so that it delays
the step's gradients as slower arithmetic would: slept after backward, it would overlap the
gradients' communication, which starts during backward.

Steps count from 1. kill, hang, nan and lose fire once per run: a restarted or resumed run does not
repeat them (the run directory records what fired). Several faults join with ';'.

nan and slow act through forward hooks on the rank's model (`during`), so they work alike
whatever a strategy runs inside a step: one forward, micro-batches through a pipeline stage, or a
parameter-server worker's forward that waits for its shards.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from paraloom.config.fault_specs import Fault

ONCE = ("kill", "hang", "nan", "lose")  # the faults that fire once per run (the slow ones persist)
NODE = "PARALOOM_NODE"  # set by the cluster launcher: the node a worker runs on


class FaultInjector:
    """Fires this rank's faults from the training loop; one per run for kill, hang and nan."""

    def __init__(self, faults: list[Fault], *, rank: int, world_size: int, seed: int,
                 run_dir: Path | None) -> None:
        self.rank, self.world_size, self.seed, self.run_dir = rank, world_size, seed, run_dir
        node = os.environ.get(NODE)
        self.once = [f for f in faults if f.kind in ONCE and not self._fired(f)
                     and (f.rank == rank if f.kind != "lose" else node is not None and f.node == int(node))]
        self.slow = [f for f in faults if f.kind == "slow"]
        self.slow_data = [f.factor for f in faults if f.kind == "slow_data" and f.rank == rank]
        self.compute_seconds: float | None = None  # the last step's forward and backward (`computed`)
        self.slept = 0.0  # seconds `stretch` slept in the current step

    def _marker(self, fault: Fault) -> Path | None:
        if self.run_dir is None:
            return None
        who = f"node{fault.node}" if fault.kind == "lose" else f"rank{fault.rank}"
        return self.run_dir / f".fired-{fault.kind}-{who}-step{fault.step}"

    def _fired(self, fault: Fault) -> bool:
        marker = self._marker(fault)
        return marker is not None and marker.exists()

    def _mark(self, fault: Fault) -> None:
        marker = self._marker(fault)
        if marker is not None:
            marker.touch()

    def before_step(self, step: int) -> None:
        """At the start of 1-based `step`: kill, hang or lose this rank (or its node) if asked."""
        for fault in self.once:
            if fault.step == step and fault.kind in ("kill", "hang", "lose"):
                self._mark(fault)
                if fault.kind == "lose":  # the node's elastic agent first: nothing restarts this rank
                    os.kill(os.getppid(), signal.SIGKILL)
                if fault.kind in ("kill", "lose"):
                    os.kill(os.getpid(), signal.SIGKILL)
                while True:  # hang: never answer again (the others' collectives time out)
                    time.sleep(3600)

    def poison(self, step: int) -> bool:
        """Whether this rank's gradients of `step` are to be NaN."""
        for fault in self.once:
            if fault.step == step and fault.kind == "nan":
                self._mark(fault)
                self.once.remove(fault)
                return True
        return False

    def slow_factor(self, step: int) -> float:
        """How much longer this rank's computation of `step` is to take (1.0: as it is)."""
        factor = 1.0
        for fault in self.slow:
            rank = fault.rank
            if rank is None:  # a stream every rank computes alike: no communication needed
                rank = random.Random(self.seed * 1_000_003 + step).randrange(self.world_size)
            if rank == self.rank:
                factor *= fault.factor
        return factor

    def delay_data(self) -> None:
        """slow_data: hold this rank's batch back (factor - 1) x the last step's computation."""
        if self.slow_data and self.compute_seconds is not None:
            time.sleep((math.prod(self.slow_data) - 1.0) * self.compute_seconds)

    def stretch(self, step: int, forward_seconds: float) -> float:
        """Between forward and backward of `step`: sleep (factor - 1) x the step's computation if
        this rank is slow in it, the computation estimated as the last step's forward and backward
        (the first step's as 3x its forward). Returns the seconds slept."""
        factor = self.slow_factor(step)
        if factor <= 1.0:
            return 0.0
        estimate = self.compute_seconds if self.compute_seconds is not None else 3.0 * forward_seconds
        seconds = (factor - 1.0) * estimate
        time.sleep(seconds)
        self.slept += seconds
        return seconds

    @contextlib.contextmanager
    def during(self, step: int, model: nn.Module) -> Iterator[None]:
        """Around 1-based `step`'s forward and backward: NaN outputs of `model` (nan) and a sleep after
        its first forward (slow), through hooks that are there only in the steps that need them."""
        self.slept = 0.0
        poison, slow = self.poison(step), self.slow_factor(step) > 1.0
        if not (poison or slow):
            yield
            return
        began: list[float] = []

        def before(module: nn.Module, args) -> None:
            began.append(time.perf_counter())

        def after(module: nn.Module, args, out):
            if slow and len(began) == 1:  # the step's first forward (a pipeline stage runs several)
                self.stretch(step, time.perf_counter() - began[0])
            if not (poison and isinstance(out, torch.Tensor)):
                return out
            poisoned = out * float("nan")
            poisoned.__dict__.update(out.__dict__)  # the output's marks (vocabulary-sharded logits)
            return poisoned

        handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def computed(self, seconds: float) -> None:
        """Record a step's forward and backward seconds (no waiting, no sleep) for `stretch`."""
        self.compute_seconds = seconds

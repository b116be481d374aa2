"""Fault injection for tests and benchmarks: `kill`, `hang`, `nan` and `slow` at a rank and step.

    --inject kill:rank=1,step=30        the rank SIGKILLs itself as step 30 begins
    --inject hang:rank=2,step=10        the rank stops answering (sleeps) as step 10 begins
    --inject nan:rank=0,step=5          the rank's gradients of step 5 are NaN
    --inject slow:rank=1,factor=2.0     a persistent straggler: every step of rank 1 takes 2x
    --inject slow:rank=random,factor=2  a transient one: each step one rank, drawn from a seeded
                                        stream all ranks agree on, takes 2x

A slow step's extra time is slept between forward and backward (`stretch`), so that it delays
the step's gradients as slower arithmetic would: slept after backward, it would overlap the
gradients' communication, which starts during backward.

Steps count from 1. kill, hang and nan fire once per run: a restarted or resumed run does not
repeat them (the run directory records what fired). Several faults join with ';'.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from paraloom.errors import UserError

KINDS = {"kill": ("rank", "step"), "hang": ("rank", "step"), "nan": ("rank", "step"),
         "slow": ("rank", "factor")}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: a random rank each step (slow only)
    step: int | None = None
    factor: float = 1.0

    def text(self) -> str:
        rank = "random" if self.rank is None else self.rank
        tail = f"step={self.step}" if self.step is not None else f"factor={self.factor:g}"
        return f"{self.kind}:rank={rank},{tail}"


def parse_faults(text: str) -> list[Fault]:
    faults = [_parse_one(part.strip()) for part in text.split(";") if part.strip()]
    if not faults:
        raise UserError("run.inject is empty; give e.g. kill:rank=1,step=30")
    return faults


def _parse_one(spec: str) -> Fault:
    kind, sep, rest = spec.partition(":")
    if kind not in KINDS:
        raise UserError(f"--inject {spec!r}: unknown fault {kind!r}; choose one of: {', '.join(KINDS)}")
    wanted = KINDS[kind]
    values: dict[str, str] = {}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.strip().partition("=")
        if not eq or key not in wanted or key in values:
            raise UserError(f"--inject {spec!r}: expected {kind}:" + ",".join(f"{k}=..." for k in wanted))
        values[key] = value.strip()
    if set(values) != set(wanted):
        raise UserError(f"--inject {spec!r}: expected {kind}:" + ",".join(f"{k}=..." for k in wanted))
    rank_text = values["rank"]
    if rank_text == "random" and kind == "slow":
        rank = None
    elif rank_text.isdigit():
        rank = int(rank_text)
    else:
        allowed = "a rank number or 'random'" if kind == "slow" else "a rank number"
        raise UserError(f"--inject {spec!r}: rank must be {allowed}, got {rank_text!r}")
    if kind == "slow":
        try:
            factor = float(values["factor"])
        except ValueError:
            raise UserError(f"--inject {spec!r}: factor must be a number, got {values['factor']!r}") from None
        if not 1.0 <= factor <= 100.0:
            raise UserError(f"--inject {spec!r}: factor must lie in [1, 100], got {factor:g}")
        return Fault(kind, rank, factor=factor)
    if not values["step"].isdigit() or int(values["step"]) < 1:
        raise UserError(f"--inject {spec!r}: step must be a whole number >= 1, got {values['step']!r}")
    return Fault(kind, rank, step=int(values["step"]))


def check_faults(faults: list[Fault], world_size: int, total_steps: int | None = None) -> None:
    """Refuse ranks outside the world and steps past the end of the run."""
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            raise UserError(f"--inject {fault.text()}: rank {fault.rank} is out of range; "
                            f"this run has ranks 0..{world_size - 1}")
        if fault.step is not None and total_steps is not None and fault.step > total_steps:
            raise UserError(f"--inject {fault.text()}: step {fault.step} is out of range; "
                            f"this run has steps 1..{total_steps}")


class FaultInjector:
    """Fires this rank's faults from the training loop; one per run for kill, hang and nan."""

    def __init__(self, faults: list[Fault], *, rank: int, world_size: int, seed: int,
                 run_dir: Path | None) -> None:
        self.rank, self.world_size, self.seed, self.run_dir = rank, world_size, seed, run_dir
        self.once = [f for f in faults if f.kind != "slow" and f.rank == rank and not self._fired(f)]
        self.slow = [f for f in faults if f.kind == "slow"]
        self.compute_seconds: float | None = None  # the last step's forward and backward (`computed`)

    def _marker(self, fault: Fault) -> Path | None:
        if self.run_dir is None:
            return None
        return self.run_dir / f".fired-{fault.kind}-rank{fault.rank}-step{fault.step}"

    def _fired(self, fault: Fault) -> bool:
        marker = self._marker(fault)
        return marker is not None and marker.exists()

    def _mark(self, fault: Fault) -> None:
        marker = self._marker(fault)
        if marker is not None:
            marker.touch()

    def before_step(self, step: int) -> None:
        """At the start of 1-based `step`: kill or hang this rank if asked."""
        for fault in self.once:
            if fault.step == step and fault.kind in ("kill", "hang"):
                self._mark(fault)
                if fault.kind == "kill":
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
        return seconds

    def computed(self, seconds: float) -> None:
        """Record a step's forward and backward seconds (no waiting, no sleep) for `stretch`."""
        self.compute_seconds = seconds

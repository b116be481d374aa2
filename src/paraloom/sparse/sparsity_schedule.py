"""Sparsity schedules: when to prune and to what sparsity (one-shot, or gradual with a cubic ramp)."""

from __future__ import annotations

from dataclasses import dataclass

from paraloom.config.choices import PRUNING_SCHEDULES
from paraloom.config.errors import UserError


def cubic_sparsity(step: int, *, initial: float, final: float, start: int, end: int) -> float:
    """Target sparsity at `step`: `initial` before `start`, a cubic ramp up to `final` at `end`, then flat.

    Zhu & Gupta 2017, "To prune, or not to prune" (arXiv:1710.01878), eq. 1:
    s_t = s_f + (s_i - s_f) * (1 - (t - t_0) / (n * dt))**3 for t_0 <= t <= t_0 + n * dt.
    Here t_0 = start and t_0 + n * dt = end; with start == end the ramp is a step at `start`.
    """
    if step >= end:
        return final
    if step <= start:
        return initial
    return final + (initial - final) * (1.0 - (step - start) / (end - start)) ** 3


def is_prune_step(step: int, start: int, end: int, every: int) -> bool:
    """True at start, start + every, start + 2 * every, ... while the step is not past `end`."""
    return start <= step <= end and (step - start) % every == 0


@dataclass(frozen=True)
class SparsitySchedule:
    """When masks are recomputed (`due`) and at what sparsity (`target`).

    `oneshot`: prune once, at step `start`, straight to `final` (`end` and `every` unused).
    `gradual`: prune every `every` steps from `start` to `end`, following `cubic_sparsity`
    from `initial` to `final`; `end - start` must be a multiple of `every` so `final` is reached.
    """

    kind: str  # "oneshot" | "gradual"
    final: float  # sparsity (fraction of weights zero) at the end, in [initial, 1)
    initial: float = 0.0  # gradual only: sparsity of the first prune, at `start`
    start: int = 0  # first step that prunes
    end: int | None = None  # gradual: last step that prunes (required); oneshot: ignored
    every: int = 1  # gradual: steps between prunes (Zhu & Gupta's dt)

    def __post_init__(self) -> None:
        if self.kind not in PRUNING_SCHEDULES:
            raise UserError(f"sparsity schedule kind={self.kind!r} is unknown; choose one of "
                            f"{', '.join(PRUNING_SCHEDULES)}")
        if not 0.0 <= self.initial <= self.final < 1.0:
            raise UserError(f"sparsity initial={self.initial!r}, final={self.final!r} must satisfy "
                            "0 <= initial <= final < 1 (final=1 would prune every weight)")
        if self.start < 0:
            raise UserError(f"sparsity start={self.start} must be >= 0")
        if self.every < 1:
            raise UserError(f"sparsity every={self.every} must be >= 1 (steps between prunes)")
        if self.kind == "oneshot":
            if self.end is not None and self.end < self.start:
                raise UserError(f"sparsity start={self.start} is after end={self.end}; "
                                "need start <= end (or leave end unset for oneshot)")
            return
        if self.end is None:
            raise UserError("a gradual sparsity schedule needs end=, the last pruning step")
        if self.end < self.start:
            raise UserError(f"sparsity start={self.start} is after end={self.end}; need start <= end")
        if (self.end - self.start) % self.every:
            lower = self.end - (self.end - self.start) % self.every
            raise UserError(f"sparsity end - start = {self.end - self.start} is not a multiple of "
                            f"every={self.every}, so final sparsity would never be reached; "
                            f"use end={lower} or end={lower + self.every}")

    def target(self, step: int) -> float:
        """Sparsity the masks should have after pruning at `step`."""
        if self.kind == "oneshot":
            return self.final if step >= self.start else self.initial
        return cubic_sparsity(step, initial=self.initial, final=self.final, start=self.start,
                              end=self.end)  # type: ignore[arg-type]

    def due(self, step: int) -> bool:
        """True when masks should be recomputed at `step`."""
        if self.kind == "oneshot":
            return step == self.start
        return is_prune_step(step, self.start, self.end, self.every)  # type: ignore[arg-type]

"""Learning-rate schedules: linear warm-up, then constant, cosine, linear or step decay."""

from __future__ import annotations

import functools
import math

import torch

from paraloom.config.errors import UserError

SCHEDULES = ("constant", "cosine", "linear", "step")


def check_schedule(*, kind: str = "constant", warmup_steps: int = 0, total_steps: int,
                   decay_steps: int | None = None, min_lr_ratio: float = 0.0, step_gamma: float = 0.1,
                   step_every: int | None = None) -> None:
    """UserError, in one line, for settings `lr_factor` cannot honour."""
    if kind not in SCHEDULES:
        raise UserError(f"optim.schedule={kind!r} is not a schedule; choose one of: {', '.join(SCHEDULES)}")
    if not total_steps >= 1:
        raise UserError(f"the run has {total_steps} optimizer steps; a schedule needs at least one")
    if not 0 <= warmup_steps < total_steps:
        raise UserError(f"optim.warmup_steps={warmup_steps} must lie in [0, {total_steps}), "
                        f"below the run's {total_steps} optimizer steps")
    if decay_steps is not None and not decay_steps >= 1:
        raise UserError(f"decay_steps={decay_steps} must be positive (or None: to the end of the run)")
    if step_every is not None and not step_every >= 1:
        raise UserError(f"optim.step_every={step_every} must be a positive number of steps")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise UserError(f"optim.min_lr_ratio={min_lr_ratio} must lie in [0, 1]")
    if not 0.0 < step_gamma <= 1.0:
        raise UserError(f"optim.step_gamma={step_gamma} must lie in (0, 1]")


def lr_factor(step: int, *, kind: str = "constant", warmup_steps: int = 0, total_steps: int,
              decay_steps: int | None = None, min_lr_ratio: float = 0.0, step_gamma: float = 0.1,
              step_every: int | None = None) -> float:
    """The share of the base learning rate used at optimizer step `step` (from 0).

    Warm-up: (step + 1) / warmup_steps for step < warmup_steps, so the first step is not lr 0
    and step warmup_steps - 1 reaches the full rate. Then, over `decay_steps` steps (None: the
    rest of the run, total_steps - warmup_steps), the factor decays from 1 to `min_lr_ratio`,
    reached at total_steps and kept after it:
      constant  1 (min_lr_ratio unused)
      cosine    min + (1 - min) * (1 + cos(pi * p)) / 2, p the share of the decay done
      linear    1 - (1 - min) * p
      step      step_gamma ** (steps since warm-up // step_every), never below min_lr_ratio;
                step_every None: a third of the decay, so the rate drops three times
    """
    check_schedule(kind=kind, warmup_steps=warmup_steps, total_steps=total_steps, decay_steps=decay_steps,
                   min_lr_ratio=min_lr_ratio, step_gamma=step_gamma, step_every=step_every)
    return _factor(step, kind, warmup_steps, total_steps, decay_steps, min_lr_ratio, step_gamma, step_every)


def _factor(step: int, kind: str, warmup_steps: int, total_steps: int, decay_steps: int | None,
            min_lr_ratio: float, step_gamma: float, step_every: int | None) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = decay_steps if decay_steps is not None else total_steps - warmup_steps
    since = step - warmup_steps
    if kind == "step":
        every = step_every if step_every is not None else max(1, span // 3)
        return max(step_gamma ** (min(since, span) // every), min_lr_ratio)
    done = min(since / span, 1.0)
    if kind == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))
    return 1.0 - (1.0 - min_lr_ratio) * done  # linear


def make_schedule(optimizer: torch.optim.Optimizer, *, kind: str = "constant", warmup_steps: int = 0,
                  total_steps: int, decay_steps: int | None = None, min_lr_ratio: float = 0.0,
                  step_gamma: float = 0.1, step_every: int | None = None
                  ) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_factor` to each group's base rate; call its `step()` after each
    optimizer step. Settings are checked here, once (UserError)."""
    check_schedule(kind=kind, warmup_steps=warmup_steps, total_steps=total_steps, decay_steps=decay_steps,
                   min_lr_ratio=min_lr_ratio, step_gamma=step_gamma, step_every=step_every)
    factor = functools.partial(_factor, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps,
                               decay_steps=decay_steps, min_lr_ratio=min_lr_ratio, step_gamma=step_gamma,
                               step_every=step_every)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

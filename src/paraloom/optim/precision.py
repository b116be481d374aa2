"""Mixed precision (`run.precision`): torch.autocast around forward and loss, and fp16's loss scaler.

bf16 keeps fp32's exponent range and trains without scaling. fp16 gradients underflow without it:
the loss is multiplied by a scale S before backward, the gradients are divided by S before the
update, and S follows the gradients (Micikevicius et al. 2018): a step whose gradients overflow
(Inf or NaN anywhere, on any rank) is skipped and S halves; after `interval` good steps in a row
S doubles. Which step overflowed is the non-finite guard's decision (all-reduced, the same on every
rank of the grid), so every rank backs off alike and the scales never drift apart.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """`torch.autocast` at `precision` on `device`'s type; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class LossScaler:
    """fp16's dynamic loss scale; `update(stepped)` after each step with the guard's decision."""

    def __init__(self, *, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000, floor: float = 1.0) -> None:
        self.scale, self.growth, self.backoff = float(init), growth, backoff
        self.interval, self.floor = interval, floor
        self.good = 0  # good steps in a row since the last change

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Divide the gradients `optimizer` is about to apply by the scale (a step pre-hook)."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, stepped: bool) -> bool:
        """Follow the step's outcome; True when a skip was the scaler's own (the scale backed off,
        above its floor), False for a skip that must count as a bad step (or a step taken)."""
        if stepped:
            self.good += 1
            if self.good >= self.interval:
                self.scale *= self.growth
                self.good = 0
            return False
        self.good = 0
        if self.scale * self.backoff < self.floor:
            return False  # at its floor: the gradients are bad whatever the scale
        self.scale *= self.backoff
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good = float(state["scale"]), int(state["good"])

"""DistributedOptimizer: the user's optimizer, whose `step()` is the engine's (Horovod's shape).

Updaters that apply the update themselves — the priority scheduler's deferred per-module
updates, one-step-delay SGD, local SGD, the sharded optimizer — cannot be driven by a plain
`optimizer.step()` on averaged gradients. Wrapped, the loop stays as written:

    model = paraloom.DataParallel(model, scheduler="priority")
    optimizer = paraloom.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)
    ...
    optimizer.zero_grad(); loss.backward(); optimizer.step()

It is a `torch.optim.Optimizer` (learning-rate schedulers accept it) that shares the wrapped
optimizer's `param_groups`, `state` and `defaults`, and saves and loads the wrapped optimizer's
state dict, so a checkpoint of one loads into the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class DistributedOptimizer(torch.optim.Optimizer):
    """`optimizer`, stepped through `model`'s engine (`model.step(optimizer)`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        # Optimizer.__init__ is not called: the wrapped optimizer owns the parameters and state
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(model, "updater"):
            raise TypeError(f"model must be a paraloom.DataParallel, got {type(model).__name__}")
        self.optimizer, self.model = optimizer, model
        self.skipped = 0  # steps the non-finite guard skipped (model.guard_nonfinite)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize as the engine's updater says and update (its `step(optimizer)`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.model.step(self.optimizer):
            self.skipped += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each step zeroes the gradients (some updaters still read them after
        `step()` returns, so they must not be dropped between steps)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("the engine's buckets are fixed when DataParallel wraps the model: "
                           "give every parameter group to the optimizer before wrapping")

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

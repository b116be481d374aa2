"""Pruning in data-parallel training: masks on schedule, pruned weights kept zero, compact gradient sync."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from paraloom.sparse.pruning import MagnitudePruner
from paraloom.sparse.sparsity_schedule import SparsitySchedule
from paraloom.sparse.sync import MaskedSync


def schedule_for(cfg, total_steps: int) -> SparsitySchedule:
    """The run's schedule from `sparse.*`; a gradual end defaults to half the run, on an `every` boundary."""
    if cfg.schedule == "oneshot":
        return SparsitySchedule("oneshot", cfg.sparsity, start=cfg.start_step)
    end = cfg.end_step if cfg.end_step is not None else max(cfg.start_step, total_steps // 2)
    end = cfg.start_step + cfg.every * -(-(end - cfg.start_step) // cfg.every)
    return SparsitySchedule("gradual", cfg.sparsity, initial=cfg.initial, start=cfg.start_step, end=end,
                            every=cfg.every)


class SparseTraining:
    """`sparse.*` on one rank: a `MagnitudePruner` on the model, `MaskedSync` as the engine's compressor."""

    def __init__(self, cfg, model: nn.Module, engine, group: dist.ProcessGroup | None,
                 total_steps: int) -> None:
        self.pruner = MagnitudePruner(model, schedule_for(cfg, total_steps), scope=cfg.scope,
                                      structured=cfg.structured, group=group)
        self.sync = MaskedSync(engine, cfg.sync_threshold)
        self.sync.set_masks(self.masks())

    def masks(self) -> dict[nn.Parameter, Any]:
        return {self.pruner.targets[name]: mask for name, mask in self.pruner.masks.items()}

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (0: before training): zero pruned weights, update masks when due."""
        self.pruner.apply()  # momentum and Adam would otherwise revive pruned weights
        if self.pruner.update(step):
            self.sync.set_masks(self.masks())

    def state_dict(self) -> dict[str, Any]:
        return self.pruner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pruner.load_state_dict(state)
        self.sync.set_masks(self.masks())

    def summary(self) -> dict[str, Any]:
        return {"sparsity": self.pruner.sparsity(), "layer_sparsity": self.pruner.layer_sparsity(),
                "gradient_density_sent": self.sync.density()}

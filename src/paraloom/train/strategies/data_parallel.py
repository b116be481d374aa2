"""Data parallelism: a whole replica on every rank, gradients averaged by the engine (pruned, if asked)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.collectives import CommStats
from paraloom.config import Config
from paraloom.data import Split
from paraloom.sparse.training import SparseTraining
from paraloom.topology import Topology
from paraloom.trace import Timeline, trace_modules
from paraloom.train.recipe import (
    batch_loss,
    evaluate,
    local_accuracy,
    make_engine,
    make_model,
    make_optimizer,
    planned_steps,
)
from paraloom.train.strategies import EngineStrategy, StepResult


class DataParallelStrategy(EngineStrategy):
    """Every rank trains the whole model on its shard of the batch; the engine syncs gradients."""


    def __init__(self, cfg: Config, split: Split, *, device: torch.device, timeline: Timeline | None) -> None:
        self.cfg, self.split = cfg, split
        self.groups = Topology.for_world(dist.get_world_size()).init_groups()
        self.dp_rank, self.dp_world_size = self.groups.dp_rank, self.groups.dp_world_size
        self.model = make_model(cfg, split).to(device)
        if timeline is not None:
            trace_modules(self.model, timeline)  # the bare model: its layers, not the engine's wrapper
        self.stats = CommStats()
        self.engine = make_engine(self.model, cfg.comm, self.groups, self.stats, timeline, cfg.optim)
        if cfg.guard.nan:
            self.engine.guard_nonfinite()
        self.optimizer = make_optimizer(cfg.optim, self.model.parameters(), cfg.comm)
        self.sparse = None
        if cfg.sparse.sparsity > 0:
            self.sparse = SparseTraining(cfg.sparse, self.model, self.engine, self.groups.dp_group,
                                         planned_steps(cfg, len(split.y_train)))
        self.resumed = False

    def begin(self) -> None:
        if self.sparse is not None and not self.resumed:
            self.sparse.after_step(0)  # a one-shot schedule at step 0 prunes before training

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, step: int,
                   saving: bool) -> StepResult:
        began = time.perf_counter()
        loss, loss_sum = batch_loss(self.engine, x, y, global_count=global_count,
                                    dp_world_size=self.dp_world_size)
        loss.backward()
        computed = time.perf_counter() - began
        stepped = self.engine.step(self.optimizer)  # synchronize, update, zero the gradients (bucket views)
        if self.sparse is not None:
            self.sparse.after_step(step)
        return StepResult(stepped, loss_sum, computed)

    def loss_value(self, result: StepResult, global_count: int) -> float:
        dist.all_reduce(result.loss, group=self.groups.dp_group)  # metric only, not counted
        return float(result.loss) / global_count

    def epoch_end(self) -> float | None:
        """Rank 0's replica on the whole test set, without communication."""
        return local_accuracy(self.model, self.split) if dist.get_rank() == 0 else None

    def finish(self) -> dict[str, Any]:
        self.engine.finish()  # deferred updates and the last delayed all-reduce land before evaluating
        return {"test_accuracy": evaluate(self.model, self.split, self.groups.dp_group)}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.model.state_dict() if dist.get_rank() == 0 else None

    def state_dict(self) -> dict[str, Any]:
        state = engine_state(self.model, self.optimizer, self.engine)
        if self.sparse is not None:
            state["sparse"] = self.sparse.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_engine_state(self.model, self.optimizer, self.engine, state)
        if self.sparse is not None:
            self.sparse.load_state_dict(state["sparse"])
        self.resumed = True

    def summary(self) -> dict[str, Any]:
        return {"sparse": self.sparse.summary()} if self.sparse is not None else {}


def engine_state(model: nn.Module, optimizer: torch.optim.Optimizer, engine) -> dict[str, Any]:
    """The engine's communication state, with model and optimizer under "shared" when every replica
    holds the same (the sync mode decides: local SGD and one-step delay make them differ)."""
    state: dict[str, Any] = {"engine": engine.comm_state_dict()}
    replicas = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if engine.replicas_identical:
        state["shared"] = replicas
    else:
        state.update(replicas)
    return state


def load_engine_state(model: nn.Module, optimizer: torch.optim.Optimizer, engine,
                      state: dict[str, Any]) -> None:
    """Load what `engine_state` gave (its "shared" part as written once, by rank 0)."""
    replicas = state if "model" in state else state.get("shared")
    if replicas is None or "model" not in replicas:
        raise RuntimeError("the checkpoint holds no model state")
    model.load_state_dict(replicas["model"])
    optimizer.load_state_dict(replicas["optimizer"])
    engine.load_comm_state_dict(state["engine"])

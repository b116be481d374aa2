"""Data parallelism: a whole replica on every rank, gradients averaged by the engine (pruned, if asked)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets
from paraloom.data_parallel.fully_sharded import parameter_names
from paraloom.data_parallel.replica_state import average_states, engine_state, load_engine_state
from paraloom.models.make import make_model
from paraloom.pipeline_parallel.resplit import load_whole
from paraloom.sparse.training import SparseTraining
from paraloom.topology import Topology
from paraloom.trace import Timeline
from paraloom.train.loss_eval import batch_loss, chunks, evaluate, planned_steps
from paraloom.train.strategies.base import EngineStrategy, StepResult, register_strategy


@register_strategy
class DataParallelStrategy(EngineStrategy):
    """Every rank trains the whole model on its shard of the batch; the engine syncs gradients."""

    name = "data_parallel"
    # a tp/pp grid's model whole again; a fully sharded run's shards read whole
    resumes_from = ("data_parallel", "model_parallel", "fully_sharded")

    def __init__(self, cfg: Config, data: DataSets, *, device: torch.device,
                 timeline: Timeline | None) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        self.groups = Topology.for_world(dist.get_world_size()).init_groups()
        self.dp_rank, self.dp_world_size = self.groups.dp_rank, self.groups.dp_world_size
        self.model = make_model(cfg, data).to(device)
        total = planned_steps(cfg, len(data.train))
        self.attach_engine(self.groups, timeline, total_steps=total)
        self.sparse = SparseTraining(cfg.sparse, self.model, self.engine, self.groups.dp_group, total) \
            if cfg.sparse.sparsity > 0 else None
        self.resumed = False

    def begin(self) -> None:
        if self.sparse is not None and not self.resumed:
            self.sparse.after_step(0)  # a one-shot schedule at step 0 prunes before training

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        began, recipe, mark = time.perf_counter(), self.recipe, self.comm_mark()
        pieces, loss_sum = chunks(x, y, recipe.accumulate), 0.0
        for i, (xs, ys) in enumerate(pieces):
            with self.engine.no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():  # sync once
                with recipe.autocast():
                    loss, part = batch_loss(self.engine, xs, ys, scale=scale, loss=self.data.loss,
                                            smoothing=self.cfg.optim.label_smoothing)
                recipe.backward(loss)
            loss_sum = part.float() + loss_sum
        computed = time.perf_counter() - began
        stepped, terms = self.timed_step(began, computed, mark)
        own_skip = recipe.after_step(stepped)
        if self.sparse is not None:
            self.sparse.after_step(step)
        # backward returns once the gradients are averaged: its wait for the peers is not computing (a
        # straggler's sleep is a multiple of it; with the wait in, a transient one's grew step by step)
        return StepResult(stepped, loss_sum, terms["compute"] + terms["codec"], own_skip, terms)

    def loss_value(self, result: StepResult, global_count: int) -> float:
        dist.all_reduce(result.loss, group=self.groups.dp_group)  # metric only, not counted
        return float(result.loss) / global_count

    def epoch_end(self) -> float | None:
        """Rank 0's replica on the whole test set, without communication."""
        return evaluate(self.model, self.data, None, self.device)["test_accuracy"] \
            if dist.get_rank() == 0 else None

    def finish(self) -> dict[str, Any]:
        self.engine.finish()  # deferred updates and the last delayed all-reduce land before evaluating
        return evaluate(self.model, self.data, self.groups.dp_group, self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.model.state_dict() if dist.get_rank() == 0 else None

    def state_dict(self) -> dict[str, Any]:
        state = engine_state(self.model, self.optimizer, self.engine)
        state["recipe"] = self.recipe.state_dict()
        if self.sparse is not None:
            state["sparse"] = self.sparse.state_dict()
        return state

    def resize_refusal(self) -> str | None:
        return None  # identical replicas; local SGD averages them, one-step delay lands its pending step

    def resize_sources(self, saved_world: int, saved_grid: list[int] | None) -> list[int]:
        # every rank's part: the replicas of local SGD, the stages and slices of a model-parallel run
        return list(range(saved_world)) if self.cfg.comm.sync == "local_sgd" or saved_grid else [0]

    def make_sharded(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        if self.cfg.comm.shard_optimizer:
            return self.engine.updater.sharded_target(shape, dtype)  # the sharded optimizer's state
        return torch.empty(shape, dtype=dtype, device=self.device)  # a fully sharded run's, read whole

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        """Identical replicas: rank 0's model, optimizer, recipe and pruning state serve every rank.
        Local SGD: every rank starts from the average of the saved replicas (parameters and optimizer
        state), as if the run had averaged at the checkpoint. One-step delay: the pending averaged
        gradients are applied to the global weights, which every rank starts from. A compressor's
        residuals (one per old rank) start again from zero."""
        if "layout" in state:  # a model-parallel checkpoint: its stages and slices, joined
            load_whole(self.model, self.optimizer, [state, *others])
            self.recipe.load_state_dict(state["recipe"])
            self.resumed = True
            return
        if "engine" not in state:  # a fully sharded run's checkpoint, its DTensors read whole
            self.load_state_dict(state)
            return
        notes = []
        if state["engine"]["compressor"]:
            notes.append(f"comm.compressor={self.cfg.comm.compressor}: its error-feedback state starts "
                         "from zero")
        if others:
            for key in ("model", "optimizer"):
                state[key] = average_states([state[key], *(other[key] for other in others)])
            state["engine"]["updater"] = {**state["engine"]["updater"], "unaveraged": False}
            notes.append(f"comm.sync=local_sgd: every rank starts from the average of the {saved_world} "
                         "saved replicas")
        delayed = self.cfg.comm.sync == "one_step_delay"
        if delayed:  # the pending gradients were summed over the saved ranks: average them over those
            updater = state["engine"]["updater"]
            updater["in_flight"] = [b * (self.dp_world_size / saved_world) for b in updater["in_flight"]]
            notes.append("comm.sync=one_step_delay: the pending averaged step is applied, and every rank "
                         "starts from the global weights")
        if dist.get_rank() == 0:
            for note in notes:
                print(f"paraloom: note: {note} on {self.dp_world_size} ranks (saved by {saved_world})",
                      file=sys.stderr)
        state["engine"] = {**state["engine"], "compressor": None}
        self.load_state_dict(state, keep_compressor=False)
        if delayed:
            with self.engine.stepping():  # the engine's own optimizer step, as in engine.step()
                self.engine.updater.land(self.optimizer)

    def load_state_dict(self, state: dict[str, Any], *, keep_compressor: bool = True) -> None:
        if "engine" not in state:  # a fully sharded run's: optimizer state keyed by parameter name
            if self.cfg.comm.shard_optimizer or self.cfg.comm.sync != "sync":
                raise UserError("a fully sharded run's checkpoint resumes as data parallel with "
                                "comm.sync=sync and parallel.shard=none; set those, or another run.out_dir")
            number = {name: i for i, name in enumerate(parameter_names(self.model, self.optimizer))}
            optimizer = state["optimizer"]
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict({
                "state": {number[name]: s for name, s in optimizer["state"].items()},
                "param_groups": [{**g, "params": [number[n] for n in g["params"]]}
                                 for g in optimizer["param_groups"]]})
            self.recipe.load_state_dict(state["recipe"])
            self.resumed = True
            return
        load_engine_state(self.model, self.optimizer, self.engine, state, keep_compressor=keep_compressor)
        self.recipe.load_state_dict(state["recipe"])
        if self.sparse is not None:
            self.sparse.load_state_dict(state["sparse"])
        self.resumed = True

    def summary(self) -> dict[str, Any]:
        return {"sparse": self.sparse.summary()} if self.sparse is not None else {}


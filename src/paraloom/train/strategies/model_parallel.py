"""Model parallelism: a dp x tp x pp grid of ranks, each holding one pipeline stage's tensor-parallel shard.

Every rank builds the whole model from the seed, keeps pipeline stage `pp_rank`'s contiguous
slice of its pieces (balanced by parameters, or by time profiled on rank 0), splits that slice
across its tensor-parallel group, and wraps it in the data-parallel engine over its dp group.
A step cuts the replica's batch into `parallel.microbatches` and runs the pipeline schedule
(`layers` mode: one micro-batch, no overlap); the engine then averages gradients over dp and
updates, or skips the step on every rank of the grid when any gradient is not finite. Short last
batches are dropped, so every step has the same micro-batch sizes. Checkpoints are per rank (each
holds its own shard) and resume on the same grid; the saved model is the whole one, gathered.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from paraloom.comm.collectives import default_timeout
from paraloom.comm.objects import gather_floats
from paraloom.comm.schedulers import SCHEDULERS
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets, Split, collate
from paraloom.data.text import VOCAB, unigram_loss
from paraloom.models.make import make_model
from paraloom.optim.groups import mark_no_decay
from paraloom.optim.trust import TrustRatioOptimizer
from paraloom.pipeline_parallel import Chunks, PipelineStage, split_microbatches, stage_module
from paraloom.pipeline_parallel.partition import model_pieces, piece_names
from paraloom.pipeline_parallel.resplit import layout, stage_states, whole_state
from paraloom.pipeline_parallel.stages import balance, bubbles, gather_stages
from paraloom.tensor_parallel import (
    apply_tp_plan,
    full_state_dict,
    is_tp_sharded,
    param_bytes,
    plan_for,
    sharded_parameters,
    sync_weights_from_first,
    tp_loss,
    trace_tensor_parallel,
)
from paraloom.tensor_parallel.mappings import gather_from_region
from paraloom.topology import Topology
from paraloom.trace import Timeline
from paraloom.train.loss_eval import evaluate, planned_steps
from paraloom.train.strategies.base import EngineStrategy, StepResult, register_strategy

EVAL_BATCH = 64


def _median(values: list[float]) -> float:
    """The first steps warm up allocators and caches."""
    return statistics.median(values[2:] or values) if values else 0.0


@dataclass
class Placement:
    """One rank's pipeline stage and what gathering the whole model needs."""

    module: nn.Module  # the stage's pieces (nn.Sequential), or its chunks (`Chunks`), tp-split
    model: nn.Module  # the whole model, its layers split by the tp plan (the stage's modules are its own)
    bounds: list[tuple[int, int]]  # each virtual stage's [first, last) pieces
    full_shapes: dict[str, tuple[torch.Size, torch.dtype]]  # the whole model's keys, shapes and dtypes
    names: list[str]  # each piece's name in the model


def place_stage(cfg: Config, data: DataSets, full: nn.Module, *, grid: tuple[int, int, int], pp_rank: int,
                tp_group: dist.ProcessGroup | None, v: int, m: int, sync_tp: bool = True) -> Placement:
    """Balance the pieces of `full` (the whole model, built from the seed) over the pp x v virtual
    stages, split it over the tp group by its plan (names as the user's model has them), keep stage
    `pp_rank`'s pieces (chunk c: virtual stage c pp + pp_rank). `sync_tp`: the tp group first takes
    its first rank's weights of the kept pieces (False: every rank already holds the same)."""
    dp, tp, pp = grid
    if data.loss == "model":
        raise UserError("tensor and pipeline parallelism compute the loss on the last stage; a data set "
                        "whose model returns its own loss (loss='model') trains under dp or ps only")
    whole = pp * v == 1  # one stage: a model that lists no pieces is one
    pieces = model_pieces(full, whole=whole)
    if pp * v > len(pieces):
        raise UserError(f"{pp * v} pipeline stages (virtual ones included) exceed model.name="
                        f"{cfg.model.name}'s {len(pieces)} pieces; lower parallel.pp or use a deeper "
                        "model")
    per_replica = cfg.data.batch_size // dp // cfg.optim.accumulate
    sample = next(iter(DataLoader(data.train, batch_size=max(1, per_replica // m), collate_fn=collate)))[0]
    bounds = balance(pieces, pp * v, by=cfg.parallel.balance, sample=sample)  # virtual stages
    # the whole model's keys and shapes, for gathering it into one state dict (save_model)
    full_shapes = {key: (value.shape, value.dtype)
                   for key, value in nn.Sequential(*pieces).state_dict().items()}
    names = piece_names(full, pieces)
    stages = [c * pp + pp_rank for c in range(v)]
    if tp > 1:
        plan = plan_for(cfg.model.tp_plan, full, tp)
        if sync_tp:  # every rank of the tp group takes its first rank's weights, of the pieces it keeps
            kept = [piece for u in stages for piece in pieces[bounds[u][0]:bounds[u][1]]]
            sync_weights_from_first(nn.ModuleList(kept), tp_group)
        apply_tp_plan(full, plan, tp_group, sync_weights=False)
        mark_no_decay(full, cfg.optim.no_decay)  # the split layers' parameters are new ones
        pieces = model_pieces(full, whole=whole)  # a piece the plan replaced is its parallel layer now
    module = stage_module(pieces, bounds, pp_rank) if v == 1 else \
        Chunks(stage_module(pieces, bounds, u) for u in stages)
    return Placement(module, full, bounds, full_shapes, names)


@register_strategy
class ModelParallelStrategy(EngineStrategy):
    """Tensor, pipeline and layer parallelism, and their hybrids with data parallelism."""

    name = "model_parallel"
    resumes_from = ("model_parallel",)  # its ranks' layouts are what a new grid cuts again

    drop_last = True

    def __init__(self, cfg: Config, data: DataSets, *, device: torch.device,
                 timeline: Timeline | None) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        world = dist.get_world_size()
        self.grid = cfg.grid(world)
        dp, tp, pp = self.grid
        topology = Topology(dp=dp, tp=tp, pp=pp)
        self.groups = groups = topology.init_groups()
        # metrics, the guard's flag, evaluation sums and checkpoints: a group of its own over every rank
        self.group = self.checkpoint_group = dist.new_group(list(range(world)), timeout=default_timeout())
        self.dp_rank, self.dp_world_size = groups.dp_rank, dp
        self.first, self.last = groups.pp_is_first_stage, groups.pp_is_last_stage
        self.peer_key = groups.pp_rank  # a stage's ranks in every replica do the same work
        self.m = 1 if cfg.parallel.mode == "layers" else cfg.parallel.microbatches
        self.schedule = "layers" if cfg.parallel.mode == "layers" else cfg.parallel.schedule
        self.v = cfg.parallel.virtual_stages if self.schedule == "interleaved_1f1b" else 1  # chunks per stage
        self.model = self._place(data, device)
        trace_tensor_parallel(self.model, timeline)
        # a scheduler that launches on this rank's own progress (priority) gets a twin of the dp
        # group for its collectives; the global norm's sum runs over the ranks that hold this
        # replica once (its tp x pp ranks)
        twin = topology.new_group("dp") if SCHEDULERS[cfg.comm.scheduler].own_group else None
        replica = topology.new_group("tp", "pp") if tp * pp > 1 else None
        sharded = sharded_parameters(self.model)
        shards = {id(p) for p in sharded}  # the global norm counts a shard on every tp rank, a whole one once
        self.attach_engine(groups, timeline, total_steps=planned_steps(cfg, len(data.train), drop_last=True),
                           guard_group=self.group, comm_group=twin, clip_group=replica,
                           counted=(lambda p: id(p) in shards) if groups.tp_rank else None)
        if isinstance(self.optimizer, TrustRatioOptimizer):  # LARS / LAMB: a shard's ratio is its tensor's
            for p in sharded:
                self.optimizer.set_segments(p, None, 1, groups.tp_group)
        self.loss_factor = 1.0  # of the loss back-propagated: fp16's scale / the accumulated runs
        smoothing = cfg.optim.label_smoothing
        loss_fn = lambda out, y: tp_loss(out, y, groups.tp_group, smoothing=smoothing) * self.loss_factor  # noqa: E731
        self.stage = PipelineStage(self.engine, pp_group=groups.pp_group, static_shapes=True,  # steps alike
                                   loss_fn=loss_fn if self.last else None, timeline=timeline,
                                   virtual_stages=self.v)
        self.step_seconds: list[float] = []
        self.peak_activation = 0

    def _place(self, data: DataSets, device: torch.device) -> nn.Module:
        """This rank's stage (its tp slice), and what gathering the whole model needs (`place_stage`)."""
        placed = place_stage(self.cfg, data, make_model(self.cfg, data), grid=self.grid,
                             pp_rank=self.groups.pp_rank, tp_group=self.groups.tp_group, v=self.v, m=self.m)
        self.bounds, self.full_shapes, self.names = placed.bounds, placed.full_shapes, placed.names
        return placed.module.to(device)

    def virtual_stages(self) -> list[int]:
        """The virtual stages this rank holds, chunk by chunk (chunk c of stage s is c pp + s)."""
        pp = self.grid[2]
        return [c * pp + self.groups.pp_rank for c in range(self.v)]

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        began, recipe, k, mark = time.perf_counter(), self.recipe, self.recipe.accumulate, self.comm_mark()
        scale = recipe.scaler.scale if recipe.scaler is not None else 1.0  # (batches are whole: drop_last)
        self.loss_factor, loss, busy = scale / k, None, 0.0
        for i, (xs, ys) in enumerate(zip(x.tensor_split(k), y.tensor_split(k), strict=True)):
            inputs = split_microbatches(xs, self.m) if self.first else None
            targets = split_microbatches(ys, self.m) if self.last else None
            with self.engine.no_sync() if i < k - 1 else contextlib.nullcontext(), recipe.autocast():
                part, measured = self.stage.step(self.schedule, inputs, targets, n_microbatches=self.m,
                                                 no_sync=self.engine.no_sync)
            loss = part if loss is None else loss + part if part is not None else None
            busy += measured.busy_seconds
            self.peak_activation = max(self.peak_activation, measured.peak_activation_bytes)
        stepped, terms = self.timed_step(began, time.perf_counter() - began, mark, busy=busy)
        own_skip = recipe.after_step(stepped)
        self.step_seconds.append(time.perf_counter() - began)
        return StepResult(stepped, loss / scale if loss is not None else None, busy, own_skip, terms)

    def loss_value(self, result: StepResult, global_count: int) -> float:
        """Mean over data-parallel replicas of the last stages' losses (tp rank 0 of each counts)."""
        reports = self.last and self.groups.tp_rank == 0
        t = torch.tensor([float(result.loss) if reports else 0.0], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t) / self.grid[0]

    def metrics(self) -> dict[str, Any]:
        return {"step_seconds": self.step_seconds[-1]} if self.step_seconds else {}

    def epoch_end(self) -> float | None:
        return self.evaluate()["test_accuracy"]

    def evaluate(self) -> dict[str, float | None]:
        """{"test_accuracy", "val_loss"} through the pipeline, forward only: data-parallel replicas
        score disjoint slices; the first stage feeds, middle stages relay, the last stage scores
        (vocabulary-parallel logits gathered for the argmax), counted once per replica."""
        tp_group = self.groups.tp_group

        def forward(x: torch.Tensor) -> torch.Tensor | None:
            out = self.stage.infer(x if self.first else None, module=self.model)
            return gather_from_region(out, tp_group) if out is not None and is_tp_sharded(out) else out

        return evaluate(self.model, self.data, self.groups.dp_group, self.device, forward=forward,
                        sum_group=self.group, counts=self.last and self.groups.tp_rank == 0, batch=EVAL_BATCH)

    def finish(self) -> dict[str, Any]:
        self.engine.finish()
        results = self.evaluate()
        if self.cfg.data.name == "text":
            results["unigram_loss"] = unigram_loss(Split(self.data.train.x, self.data.train.y,
                                                         self.data.eval.x, self.data.eval.y, VOCAB))
        return results

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on global rank 0, keyed as the user's model is: each stage's tp shards
        gathered in its tp group, then dp rank 0 / tp rank 0 of every stage sends its stage to rank 0."""
        groups, pp = self.groups, self.grid[2]
        sources = [groups.topology.rank(pp=u % pp, dp=0, tp=0) for u in range(pp * self.v)]
        return gather_stages(full_state_dict(self.model, groups.tp_group), self.bounds,
                             groups.pp_rank if self.v == 1 else self.virtual_stages(),
                             self.full_shapes, sender=groups.dp_rank == 0 and groups.tp_rank == 0,
                             source_of=sources, names=self.names)

    def state_dict(self) -> dict[str, Any]:
        state = {"grid": list(self.grid), "virtual_stages": self.v, "model": self.model.state_dict(),
                 "recipe": self.recipe.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "engine": self.engine.comm_state_dict()}
        if self.v == 1:  # what a run on another grid needs to cut this stage's state again
            groups = self.groups
            coords = {"dp": groups.dp_rank, "tp": groups.tp_rank, "pp": groups.pp_rank}
            state["layout"] = layout(self.model, first_piece=self.bounds[groups.pp_rank][0], coords=coords)
        return state

    def grid_record(self) -> list[int]:
        return [*self.grid, self.v]

    def resize_refusal(self) -> str | None:
        if self.v != 1:
            return "an interleaved schedule resumes only on the grid it saved with"
        if len(self.optimizer.param_groups) != 1:
            return "an optimizer of several parameter groups resumes only on the grid it saved with"
        return None

    def resize_sources(self, saved_world: int, saved_grid: list[int] | None) -> list[int]:
        return list(range(saved_world))  # one replica's ranks are kept: whole_state

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        """The whole model and optimizer state rebuilt from one saved replica, cut for this rank."""
        parts = [state, *others]
        if any("layout" not in part for part in parts):
            raise UserError("the checkpoint was saved by an interleaved schedule; resume it on its own grid")
        whole, whole_optim = whole_state(parts)
        model_state, optim_state = stage_states(self.model, state["optimizer"], whole, whole_optim,
                                                first_piece=self.bounds[self.groups.pp_rank][0])
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optim_state)
        self.recipe.load_state_dict(state["recipe"])
        self.engine.load_comm_state_dict(state["engine"])

    def _per_step(self, kept: list, n: int) -> torch.Tensor | None:
        """Every rank's (busy, schedule, steady-state wait) seconds of its first `n` `kept` pipeline
        steps (`n`: the fewest any rank kept): [rank, 3, step] (collective)."""
        if n == 0:
            return None
        rows = [[getattr(h, key) for h in kept[:n]] for key in ("busy_seconds", "step_seconds",
                                                                 "steady_wait_seconds")]
        return gather_floats([x for row in rows for x in row], self.group).reshape(-1, 3, n)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("grid") != list(self.grid) or state.get("virtual_stages", 1) != self.v:
            raise UserError(f"the checkpoint was written by a dp x tp x pp = {state.get('grid')} grid of "
                            f"{state.get('virtual_stages', 1)} chunk(s) per stage; this run is "
                            f"{list(self.grid)} of {self.v}: resume on the same grid")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.recipe.load_state_dict(state["recipe"])
        if "engine" in state:
            self.engine.load_comm_state_dict(state["engine"])

    def summary(self) -> dict[str, Any]:
        """Step and schedule times, bubbles, memory and partition, every rank's (collective)."""
        history = self.stage.history
        kept = history[2:] or history  # the first two steps warm up allocators and caches
        per_rank = gather_floats([_median(self.step_seconds), _median([h.busy_seconds for h in history]),
                                  _median([h.step_seconds for h in history]),
                                  _median([h.steady_wait_seconds for h in history]),
                                  float(self.groups.pp_rank), float(param_bytes(self.model)),
                                  float(self.peak_activation), float(len(kept))], self.group)
        dp, tp, pp = self.grid
        # the fill and drain read from each time's median apart, as before 2026-11-29 (noisier)
        of_medians = bubbles(per_rank[:, :5], pp, self.m, self.v)["bubble_fill_drain"]
        per_step = self._per_step(kept, int(per_rank[:, 7].min()))  # as many steps as every rank kept
        return {"grid": {"dp": dp, "tp": tp, "pp": pp}, "schedule": self.schedule, "microbatches": self.m,
                "virtual_stages": self.v, "partition": [list(b) for b in self.bounds],
                **bubbles(per_rank[:, :5], pp, self.m, self.v, per_step),
                "bubble_fill_drain_of_medians": of_medians,
                "param_bytes_per_rank": [int(b) for b in per_rank[:, 5].tolist()],
                "activation_peak_bytes_per_rank": [int(b) for b in per_rank[:, 6].tolist()]}

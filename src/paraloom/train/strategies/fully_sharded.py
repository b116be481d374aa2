"""Fully sharded data parallelism (`parallel.shard` gradients / full / hybrid) through torch's `fully_shard`.

Every rank builds the model from the seed, takes rank 0's weights, and shards it unit by unit
(data_parallel/fully_sharded.py) over the data-parallel ranks (hybrid: inside groups of
`parallel.shard_group`, replicated across them). A step runs forward and backward on this rank's
shard of the batch (accumulation's micro-batches reduce-scatter on the last one only, or each into
the shards: `parallel.shard_accumulate`), checks the gradient shards for NaN/Inf on every rank,
and steps the optimizer on the shards: clipping sums
the squared norms of the shards over the sharding group, and mixed precision is FSDP's (units
gathered in bf16/fp16, fp32 shards and optimizer state). Checkpoints hold DTensors, which DCP
reshards when another number of ranks resumes; the saved model is one full state dict on rank 0.
With `parallel.tp` > 1 every rank first cuts its tensor-parallel slice of the model (its plan, as
the model-parallel strategy does), and the slices are sharded over the rank's data-parallel ranks
(a dp x tp mesh); checkpoints keep each tp rank's slices apart, resuming at the same tp.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import empty as dtensor_empty

from paraloom.comm.collectives import CommStats
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets
from paraloom.data_parallel.fully_sharded import (
    DTYPES,
    apply_sharding,
    broadcast_from_first,
    count_collectives,
    data_group,
    data_mesh,
    describe,
    find_units,
    held_bytes,
    local,
    parameter_names,
    set_gradient_sync,
    shard_group,
    shard_mesh,
)
from paraloom.models.make import make_model
from paraloom.optim.finite import all_finite
from paraloom.optim.groups import mark_no_decay
from paraloom.optim.recipe import Recipe
from paraloom.tensor_parallel import (
    apply_tp_plan,
    full_state_dict,
    is_tp_sharded,
    plan_for,
    sharded_parameters,
    tp_loss,
    trace_tensor_parallel,
)
from paraloom.tensor_parallel.mappings import gather_from_region
from paraloom.trace import Timeline, trace_modules
from paraloom.train.loss_eval import batch_loss, chunks, evaluate, planned_steps
from paraloom.train.strategies.base import StepResult, Strategy, register_strategy


@register_strategy
class FullyShardedStrategy(Strategy):
    """Parameters, gradients and optimizer state split across the data-parallel ranks (torch's FSDP2)."""

    name = "fully_sharded"
    resumes_from = ("fully_sharded", "data_parallel")  # a data-parallel run's whole tensors, sharded here

    def __init__(self, cfg: Config, data: DataSets, *, device: torch.device,
                 timeline: Timeline | None) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        par, world = cfg.parallel, dist.get_world_size()
        dp, self.tp = cfg.grid(world)[:2]  # pp = 1 (config rules)
        self.dp_rank, self.tp_rank = divmod(dist.get_rank(), self.tp)
        self.dp_world_size = dp
        model = make_model(cfg, data).to(device)
        broadcast_from_first(model)  # the whole model: every tp rank then cuts its slice of the same one
        # hybrid's groups: a node's ranks (torchrun's LOCAL_WORLD_SIZE) unless parallel.shard_group says
        group_size = par.shard_group or max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)) // self.tp)
        self.mesh = shard_mesh(par.shard, world_size=dp, group_size=group_size, device_type=device.type,
                               tp=self.tp)
        self.tp_group = self.mesh.get_group("tp") if self.tp > 1 else None
        self.dp_group = data_group(self.mesh) if self.tp > 1 else None
        if self.tp > 1:
            self._split(model)
        if timeline is not None:
            trace_modules(model, timeline)
            trace_tensor_parallel(model, timeline)
        self.units = find_units(model, par.shard_units)
        self.placements = (Replicate(), Shard(0)) if par.shard == "hybrid" else (Shard(0),)
        compute = DTYPES[cfg.run.precision] if cfg.run.precision != "fp32" else None
        reduce = DTYPES[par.shard_reduce_dtype] if compute is not None else None
        self.sizes = self._unit_bytes(model, compute)
        self.model = apply_sharding(model, self.units, data_mesh(self.mesh), level=par.shard,
                                    reshard_after_forward=par.reshard_after_forward, param_dtype=compute,
                                    reduce_dtype=reduce, prefetch=par.shard_prefetch)
        self.stats = CommStats()
        self.counted = count_collectives(self.units, self.model, self.stats, timeline)
        mark_no_decay(self.model, cfg.optim.no_decay, model_name=f"model.name={cfg.model.name}")
        # the global norm sums every shard of one copy of the model: a tp slice on every tp rank, a
        # replicated parameter's on tp rank 0 only
        split = {id(p) for p in sharded_parameters(self.model)}
        self.recipe = Recipe(cfg, self.model.parameters(), total_steps=planned_steps(cfg, len(data.train)),
                             device=device, clip_group=shard_group(self.mesh),
                             counted=(lambda p: id(p) in split) if self.tp_rank else None)
        self.optimizer = self.recipe.optimizer
        self.comm_bytes = 0
        self.held: dict[str, int] = {}  # the most bytes this rank held, by kind (held_bytes)

    def _split(self, model: torch.nn.Module) -> None:
        """Cut every layer its tensor-parallel plan names into this rank's slice (the config's
        model.tp_plan, or the model's own), as the model-parallel strategy does."""
        cfg = self.cfg
        if self.data.loss == "model":
            raise UserError("tensor parallelism computes the loss from the model's logits; a data set whose "
                            "model returns its own loss (loss='model') trains sharded with parallel.tp=1")
        if cfg.optim.name.lower() in ("lars", "lamb"):
            raise UserError(f"optim.name={cfg.optim.name} with parallel.shard={cfg.parallel.shard} and "
                            f"parallel.tp={self.tp}: its per-tensor trust ratio is not summed over tp slices "
                            "and shards together yet; use tp=1, or parallel.shard=optimizer")
        if cfg.optim.ema is not None:
            raise UserError(f"optim.ema with parallel.shard={cfg.parallel.shard} and parallel.tp={self.tp}: "
                            "the average's tp slices are not yet kept apart in checkpoints; use tp=1 for an "
                            "EMA")
        apply_tp_plan(model, plan_for(cfg.model.tp_plan, model, self.tp), self.tp_group, sync_weights=False)

    def _unit_bytes(self, model: torch.nn.Module, compute: torch.dtype | None) -> tuple[int, int]:
        """(bytes a step's all-gathers are handed per micro-batch, bytes its reduce-scatters are handed),
        from the model's size, where torch has no per-collective hook (`count_collectives`): a gather
        takes this rank's shard, a reduce-scatter the whole gradient."""
        par = self.cfg.parallel
        numel = sum(p.numel() for p in model.parameters())
        element = (compute or torch.float32).itemsize
        reduce_element = DTYPES[par.shard_reduce_dtype].itemsize if compute is not None else 4
        shards = self.mesh.size(self.mesh.mesh_dim_names.index("shard"))
        regathered = par.reshard_after_forward and par.shard != "gradients"
        return (1 + regathered) * -(-numel // shards) * element, numel * reduce_element

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        began, recipe = time.perf_counter(), self.recipe
        pieces, loss_sum = chunks(x, y, recipe.accumulate), 0.0
        deferred = self.cfg.parallel.shard_accumulate == "unsharded"
        for i, (xs, ys) in enumerate(pieces):
            # unsharded: reduce-scatter once, on the last; sharded: every micro-batch, into the shards
            set_gradient_sync(self.model, not deferred or i == len(pieces) - 1)
            loss, part = self._loss(xs, ys, scale)
            recipe.backward(loss)
            loss_sum = part.float() + loss_sum
        computed = time.perf_counter() - began
        stepped = self._finite() if self.cfg.guard.nan else True
        if stepped:
            self.optimizer.step()  # its pre-hooks unscale (fp16) and clip
        if step <= 2 or saving:  # the optimizer's state exists from the first step on
            self._note_held()
        self.optimizer.zero_grad(set_to_none=True)
        own_skip = recipe.after_step(stepped)
        if not self.counted:  # torch offers no per-collective hook: the units' sizes tell
            gathers, reduced = self.sizes
            reductions = len(pieces) if self.cfg.parallel.shard_accumulate == "sharded" else 1
            self.comm_bytes += gathers * len(pieces) + reduced * reductions
        update = time.perf_counter() - began - computed
        # FSDP's gathers and reduce-scatters overlap the compute they sit in: not told apart here
        terms = {"compute": computed, "communication": 0.0, "codec": 0.0, "update": update}
        return StepResult(stepped, loss_sum, computed, own_skip, terms)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to back-propagate, this shard's summed loss) as `batch_loss`; with tensor parallelism
        from vocabulary-parallel logits (`tp_loss`), the mean over targets times the samples."""
        smoothing = self.cfg.optim.label_smoothing
        if self.tp == 1:
            return batch_loss(self.model, x, y, scale=scale, loss=self.data.loss, smoothing=smoothing)
        loss_sum = tp_loss(self.model(x), y, self.tp_group, smoothing=smoothing) * len(x)
        reported = loss_sum.detach() if scale else torch.zeros_like(loss_sum.detach())
        return loss_sum * scale, reported

    def _finite(self) -> bool:
        """Whether every rank's gradient shards are finite (one all-reduce of a flag)."""
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        bad = torch.tensor([0.0 if all_finite(grads) else 1.0], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _note_held(self) -> None:
        held = held_bytes(self.model.parameters(), self.optimizer)
        self.held = {key: max(value, self.held.get(key, 0)) for key, value in held.items()}

    def loss_value(self, result: StepResult, global_count: int) -> float:
        dist.all_reduce(result.loss)  # metric only, not counted; every tp rank holds its replica's loss
        return float(result.loss) / global_count / self.tp

    def take_comm(self) -> tuple[int, float]:
        """Bytes handed to the all-gathers and reduce-scatters (hybrid's all-reduce across groups not
        counted); no seconds: they overlap the compute they sit in."""
        if self.counted:
            return self.stats.take().bytes, 0.0
        sent, self.comm_bytes = self.comm_bytes, 0
        return sent, 0.0

    def learning_rate(self) -> float:
        return self.recipe.learning_rate()

    def loss_scale(self) -> float | None:
        return self.recipe.scaler.scale if self.recipe.scaler is not None else None

    def _evaluate(self) -> dict[str, Any]:
        # every rank scores its slice; a sharded model gathers its units in each forward, so every rank
        # makes as many forwards as the one with most batches (`lockstep`)
        if self.tp == 1:
            return evaluate(self.model, self.data, None, self.device, lockstep=True)

        def forward(x: torch.Tensor) -> torch.Tensor:  # vocabulary-parallel logits gathered for the argmax
            out = self.model(x)
            return gather_from_region(out, self.tp_group) if is_tp_sharded(out) else out

        # the tp ranks of a replica score the same slice (their data-parallel group's), counted once
        return evaluate(self.model, self.data, self.dp_group, self.device, lockstep=True, forward=forward,
                        sum_group=dist.group.WORLD, counts=self.tp_rank == 0)

    def epoch_end(self) -> float | None:
        return self._evaluate()["test_accuracy"]

    def finish(self) -> dict[str, Any]:
        return self._evaluate()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        # with tensor parallelism every rank gathers its tp slice whole over its data-parallel ranks,
        # then the tp group its slices (collective over both, on every rank)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=self.tp == 1))
        if self.tp > 1:
            state = full_state_dict(self.model, self.tp_group, state=state)
        return state if dist.get_rank() == 0 else None

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer, "recipe": self.recipe.state_dict()}
        # each tp rank's slices are tensors of their own, sharded over its data-parallel ranks
        return {f"tp{self.tp_rank}of{self.tp}": state} if self.tp > 1 else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = f"tp{self.tp_rank}of{self.tp}"
        if self.tp > 1 or any(key.startswith("tp") and "of" in key for key in state):
            if own not in state:
                raise UserError(f"this checkpoint was saved at another tensor-parallel size than "
                                f"parallel.tp={self.tp} with parallel.shard={self.cfg.parallel.shard}; "
                                "resume it at the tp it was saved with (the data-parallel size may change), "
                                "or set another run.out_dir to start afresh")
            state = state[own]
        if "engine" in state:  # a data-parallel run's checkpoint: whole tensors, optimizer state by index
            if state["engine"]["updater"]:  # plain synchronous sync keeps none
                raise UserError("this checkpoint was saved by a data-parallel run whose updater keeps state "
                                "of its own (parallel.shard=optimizer, comm.scheduler=priority, comm.sync="
                                "one_step_delay or local_sgd); resume it with the settings it was saved "
                                "with, or set another run.out_dir to start afresh")
            replicas = state if "model" in state else state["shared"]
            optimizer = replicas["optimizer"]
            names = parameter_names(self.model, self.optimizer)
            by_name = {"state": {names[i]: s for i, s in optimizer["state"].items()},
                       "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                        for g in optimizer["param_groups"]]}
            set_state_dict(self.model, self.optimizer, model_state_dict=replicas["model"],
                           optim_state_dict=by_name, options=StateDictOptions(full_state_dict=True))
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        self.recipe.load_state_dict(state["recipe"])

    def make_sharded(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        return dtensor_empty(shape, dtype=dtype, device_mesh=data_mesh(self.mesh),
                             placements=self.placements)

    def resize_refusal(self) -> str | None:
        return None  # DCP reshards every DTensor into this run's layout (at the tp it was saved with)

    def resize_sources(self, saved_world: int, saved_grid: list[int] | None) -> list[int]:
        return [self.tp_rank]  # the saved world's first replica: rank t holds tp slice t's skeleton

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        self.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.held)
        return {"shard": {"level": self.cfg.parallel.shard, "units": describe(self.units),
                          "mesh": list(self.mesh.shape),
                          "held_mb_per_rank": [{k: v / 2**20 for k, v in held.items()} for held in gathered]}}

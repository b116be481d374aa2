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
With `parallel.pp` > 1 every rank keeps its pipeline stage's pieces (balanced and tp-split as the
model-parallel strategy places them) and shards those over the stage's data-parallel ranks (a
pp x dp x tp mesh); a step runs the pipeline schedule over the stage, whose units are gathered at the
first micro-batch and kept until the step's last backward, which reduce-scatters (no gather per
micro-batch; the backwards before it add the gradients up whole, or reduce-scatter them into the
shards with `shard_accumulate=sharded`). Checkpoints keep each stage's shards apart.
"""

from __future__ import annotations

import contextlib
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
    FSDPModule,
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
from paraloom.optim.trust import TrustRatioOptimizer
from paraloom.pipeline_parallel import PipelineStage, split_microbatches
from paraloom.pipeline_parallel.stages import gather_stages
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
from paraloom.topology import Topology
from paraloom.trace import Timeline, trace_modules
from paraloom.train.loss_eval import batch_loss, chunks, evaluate, planned_steps
from paraloom.train.strategies.base import StepResult, Strategy, register_strategy
from paraloom.train.strategies.model_parallel import EVAL_BATCH, place_stage


@register_strategy
class FullyShardedStrategy(Strategy):
    """Parameters, gradients and optimizer state split across the data-parallel ranks (torch's FSDP2)."""

    name = "fully_sharded"
    resumes_from = ("fully_sharded", "data_parallel")  # a data-parallel run's whole tensors, sharded here

    def __init__(self, cfg: Config, data: DataSets, *, device: torch.device,
                 timeline: Timeline | None) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        par, world = cfg.parallel, dist.get_world_size()
        dp, self.tp, self.pp = cfg.grid(world)
        coord = Topology(dp=dp, tp=self.tp, pp=self.pp).coord(dist.get_rank())
        self.pp_rank, self.dp_rank, self.tp_rank = coord
        self.dp_world_size = dp
        model = make_model(cfg, data).to(device)
        broadcast_from_first(model)  # the whole model: every tp rank then cuts its slice of the same one
        # hybrid's groups: a node's ranks (torchrun's LOCAL_WORLD_SIZE) unless parallel.shard_group says
        group_size = par.shard_group or max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)) // self.tp)
        self.mesh = shard_mesh(par.shard, world_size=dp, group_size=group_size, device_type=device.type,
                               tp=self.tp, pp=self.pp)
        self.tp_group = self.mesh.get_group("tp") if self.tp > 1 else None
        self.dp_group = data_group(self.mesh) if self.tp * self.pp > 1 else None
        if self.tp * self.pp > 1:
            self._refuse_sliced()
        self.stage: PipelineStage | None = None
        whole = model
        if self.pp > 1:  # this rank keeps its stage's pieces (tp-split): the stage is what is sharded
            self.m = par.microbatches
            self.schedule = par.schedule
            self.v = par.virtual_stages if self.schedule == "interleaved_1f1b" else 1
            self.drop_last = True  # every step's micro-batches alike (the stage's static shapes)
            placed = place_stage(cfg, data, model, grid=(dp, self.tp, self.pp), pp_rank=self.pp_rank,
                                 tp_group=self.tp_group, v=self.v, m=self.m, sync_tp=False)
            model, whole = placed.module.to(device), placed.model
            self.bounds, self.full_shapes, self.names = placed.bounds, placed.full_shapes, placed.names
        elif self.tp > 1:
            self._split(model)
        if timeline is not None:
            trace_modules(model, timeline)
            trace_tensor_parallel(model, timeline)
        kept = {id(m) for m in model.modules()}  # units as the whole model names them, of this stage
        self.units = [(n, m) for n, m in find_units(whole, par.shard_units) if id(m) in kept]
        self.placements = (Replicate(), Shard(0)) if par.shard == "hybrid" else (Shard(0),)
        compute = DTYPES[cfg.run.precision] if cfg.run.precision != "fp32" else None
        reduce = DTYPES[par.shard_reduce_dtype] if compute is not None else None
        self.sizes = self._unit_bytes(model, compute)
        self.model = apply_sharding(model, self.units, data_mesh(self.mesh), level=par.shard,
                                    # a pipeline gathers a unit once a step, not per micro-batch
                                    reshard_after_forward=par.reshard_after_forward and self.pp == 1,
                                    param_dtype=compute,
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
        if isinstance(self.optimizer, TrustRatioOptimizer) and self.tp > 1:  # LARS / LAMB: a tp slice's
            for p in sharded_parameters(self.model):  # ratio sums its shards, then the tp group's slices
                self.optimizer.set_segments(p, None, 1, self.tp_group)
        self.comm_bytes = 0
        self.held: dict[str, int] = {}  # the most bytes this rank held, by kind (held_bytes)
        if self.pp > 1:
            self._pipeline(timeline)

    def _refuse_sliced(self) -> None:
        """What does not run yet where a rank holds a slice of the model (tp) or a stage of it (pp)."""
        if self.data.loss == "model":
            raise UserError("tensor and pipeline parallelism compute the loss from the model's logits; a "
                            "data set whose model returns its own loss (loss='model') trains sharded with "
                            "parallel.tp=1 and parallel.pp=1")

    def _split(self, model: torch.nn.Module) -> None:
        """Cut every layer its tensor-parallel plan names into this rank's slice (the config's
        model.tp_plan, or the model's own), as the model-parallel strategy does."""
        plan = plan_for(self.cfg.model.tp_plan, model, self.tp)
        apply_tp_plan(model, plan, self.tp_group, sync_weights=False)

    def _unit_bytes(self, model: torch.nn.Module, compute: torch.dtype | None) -> tuple[int, int]:
        """(bytes a step's all-gathers are handed per micro-batch, bytes its reduce-scatters are handed),
        from the model's size, where torch has no per-collective hook (`count_collectives`): a gather
        takes this rank's shard, a reduce-scatter the whole gradient."""
        par = self.cfg.parallel
        numel = sum(p.numel() for p in model.parameters())
        element = (compute or torch.float32).itemsize
        reduce_element = DTYPES[par.shard_reduce_dtype].itemsize if compute is not None else 4
        shards = self.mesh.size(self.mesh.mesh_dim_names.index("shard"))
        regathered = par.reshard_after_forward and par.shard != "gradients" and self.pp == 1
        return (1 + regathered) * -(-numel // shards) * element, numel * reduce_element

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        if self.stage is not None:
            return self._pipeline_step(x, y, note=step <= 2 or saving)
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

    # ---- with pipeline parallelism: this rank's stage is what is sharded

    def _pipeline(self, timeline: Timeline | None) -> None:
        """The pipeline stage that runs the sharded stage's schedule (static shapes: drop_last)."""
        smoothing, tp_group = self.cfg.optim.label_smoothing, self.tp_group
        self.loss_factor = 1.0  # of the loss back-propagated: fp16's scale / the accumulated runs
        loss_fn = lambda out, y: tp_loss(out, y, tp_group, smoothing=smoothing) * self.loss_factor  # noqa: E731
        last = self.pp_rank == self.pp - 1
        self.stage = PipelineStage(self.model, pp_group=self.mesh.get_group("pp"), static_shapes=True,
                                   loss_fn=loss_fn if last else None, timeline=timeline,
                                   virtual_stages=self.v)

    def _backward_mode(self, last: bool) -> None:
        """How the next backward leaves the stage's units: on a step's last, gradients reduce-scattered and
        the units resharded; before it, kept gathered (no re-gather per micro-batch) with gradients
        accumulated whole (`shard_accumulate=unsharded`) or reduce-scattered into the shards."""
        set_gradient_sync(self.model, last or self.cfg.parallel.shard_accumulate == "sharded")
        self.model.set_reshard_after_backward(last, recurse=True)

    @contextlib.contextmanager
    def _holding(self, final: bool):
        """Every backward of a pipeline step but its last (`PipelineStage.step`'s no_sync): units kept."""
        self._backward_mode(False)
        try:
            yield
        finally:
            self._backward_mode(final)

    def _reshard(self) -> None:
        """Free every gathered unit (after a forward-only pass, or a step a unit's last backward left)."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor, *, note: bool) -> StepResult:
        """One step of a replica's batch through the stages: k accumulation runs of the schedule over
        its micro-batches, units gathered once and reduce-scattered at the end (or every micro-batch)."""
        began, recipe, k = time.perf_counter(), self.recipe, self.recipe.accumulate
        scale = recipe.scaler.scale if recipe.scaler is not None else 1.0  # (batches are whole: drop_last)
        self.loss_factor, loss, busy = scale / k, None, 0.0
        first, last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        for i, (xs, ys) in enumerate(zip(x.tensor_split(k), y.tensor_split(k), strict=True)):
            final = i == k - 1
            self._backward_mode(final)
            inputs = split_microbatches(xs, self.m) if first else None
            targets = split_microbatches(ys, self.m) if last else None
            part, measured = self.stage.step(self.schedule, inputs, targets, n_microbatches=self.m,
                                             no_sync=lambda final=final: self._holding(final))
            loss = part if loss is None else loss + part if part is not None else None
            busy += measured.busy_seconds
        self._reshard()  # a no-op unless a unit's last backward was not the step's
        stepped = self._finite() if self.cfg.guard.nan else True
        if stepped:
            self.optimizer.step()  # its pre-hooks unscale (fp16) and clip
        if note:  # the optimizer's state exists from the first step on
            self._note_held()
        self.optimizer.zero_grad(set_to_none=True)
        own_skip = recipe.after_step(stepped)
        if not self.counted:
            gathers, reduced = self.sizes
            summed_sharded = self.cfg.parallel.shard_accumulate == "sharded"
            self.comm_bytes += gathers + reduced * (k * self.m if summed_sharded else 1)
        update = time.perf_counter() - began - busy
        terms = {"compute": busy, "communication": 0.0, "codec": 0.0, "update": update}
        return StepResult(stepped, loss / scale if loss is not None else None, busy, own_skip, terms)

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
        if self.stage is not None:  # the last stages' mean losses (tp rank 0 of each), over the replicas
            reports = self.pp_rank == self.pp - 1 and self.tp_rank == 0
            t = torch.tensor([float(result.loss) if reports else 0.0], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t) / self.dp_world_size
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
        if self.tp * self.pp == 1:
            return evaluate(self.model, self.data, None, self.device, lockstep=True)
        first, last = self.pp_rank == 0, self.pp_rank == self.pp - 1

        def forward(x: torch.Tensor) -> torch.Tensor | None:  # vocabulary-parallel logits gathered
            out = self.model(x) if self.stage is None else \
                self.stage.infer(x if first else None, module=self.model)  # first feeds, last scores
            return gather_from_region(out, self.tp_group) if out is not None and is_tp_sharded(out) else out

        # the tp ranks and stages of a replica score the same slice (their data-parallel group's), its
        # last stage's tp rank 0 counts it
        results = evaluate(self.model, self.data, self.dp_group, self.device, lockstep=True, forward=forward,
                           sum_group=dist.group.WORLD, counts=last and self.tp_rank == 0,
                           **({"batch": EVAL_BATCH} if self.stage is not None else {}))
        if self.stage is not None:
            self._reshard()  # a pipeline's units stay gathered after a forward
        return results

    def epoch_end(self) -> float | None:
        return self._evaluate()["test_accuracy"]

    def finish(self) -> dict[str, Any]:
        return self._evaluate()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        # with tensor parallelism every rank gathers its tp slice whole over its data-parallel ranks,
        # then the tp group its slices (collective over both, on every rank); with pipeline parallelism
        # that is the stage's, which its first rank then sends to rank 0
        state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=self.tp * self.pp == 1))
        if self.tp > 1:
            state = full_state_dict(self.model, self.tp_group, state=state)
        if self.stage is not None:
            topology = Topology(dp=self.dp_world_size, tp=self.tp, pp=self.pp)
            sources = [topology.rank(pp=u % self.pp) for u in range(self.pp * self.v)]
            stages = self.pp_rank if self.v == 1 else [c * self.pp + self.pp_rank for c in range(self.v)]
            state = {key: value.cpu() for key, value in state.items()}
            return gather_stages(state, self.bounds, stages, self.full_shapes,
                                 sender=self.dp_rank == 0 and self.tp_rank == 0, source_of=sources,
                                 names=self.names)
        return state if dist.get_rank() == 0 else None

    def checkpoint_namespace(self) -> str | None:
        """This rank's part of a checkpoint where ranks hold different tensors of one name (a tp slice,
        a pipeline stage's pieces): those are kept apart, each sharded over its data-parallel ranks."""
        if self.pp > 1:
            return f"pp{self.pp_rank}of{self.pp}" + (f"_tp{self.tp_rank}of{self.tp}" if self.tp > 1 else "")
        return f"tp{self.tp_rank}of{self.tp}" if self.tp > 1 else None

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer, "recipe": self.recipe.state_dict()}
        own = self.checkpoint_namespace()
        return {own: state} if own is not None else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = self.checkpoint_namespace()
        if own is not None or any(key.startswith(("tp", "pp")) and "of" in key for key in state):
            if own not in state:
                raise UserError(f"this checkpoint was saved at another tensor- or pipeline-parallel size "
                                f"than parallel.tp={self.tp} and parallel.pp={self.pp} with parallel.shard="
                                f"{self.cfg.parallel.shard}; resume it at the tp and pp it was saved with "
                                "(the data-parallel size may change), or set another run.out_dir to start "
                                "afresh")
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
        """The saved rank of the first data-parallel replica that held this rank's tp slice and stage:
        its checkpoint part names the tensors this rank loads (DCP reshards them over the new dp)."""
        saved_tp, saved_pp = saved_grid if saved_grid is not None else (self.tp, 1)
        if (saved_tp, saved_pp) != (self.tp, self.pp):
            raise UserError(f"this checkpoint was saved at parallel.tp={saved_tp} and parallel.pp="
                            f"{saved_pp}, "
                            f"this run has tp={self.tp} and pp={self.pp} with parallel.shard="
                            f"{self.cfg.parallel.shard}: resume it at the tp and pp it was saved with (the "
                            "data-parallel size may change), or set another run.out_dir to start afresh")
        saved_dp = saved_world // (self.tp * self.pp)
        return [Topology(dp=saved_dp, tp=self.tp, pp=self.pp).rank(pp=self.pp_rank, tp=self.tp_rank)]

    def grid_record(self) -> list[int] | None:
        return [self.tp, self.pp] if self.pp > 1 else None  # (tp alone: None, as runs before pp kept)

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        self.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.held)
        out = {"shard": {"level": self.cfg.parallel.shard, "units": describe(self.units),
                         "mesh": list(self.mesh.shape),
                         "held_mb_per_rank": [{k: v / 2**20 for k, v in held.items()} for held in gathered]}}
        if self.stage is not None:
            partition = [list(b) for b in self.bounds]
            out["shard"].update(pipeline={"pp": self.pp, "schedule": self.schedule, "microbatches": self.m,
                                          "virtual_stages": self.v, "partition": partition})
        return out

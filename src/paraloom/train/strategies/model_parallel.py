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

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.comm.collectives import CommStats, default_timeout
from paraloom.comm.objects import gather_floats
from paraloom.config import Config
from paraloom.data import Split
from paraloom.errors import UserError
from paraloom.pipeline_parallel import PipelineStage, split_microbatches, stage_module
from paraloom.pipeline_parallel.stages import balance, bubbles, gather_stages
from paraloom.tensor_parallel import (
    apply_tensor_parallel,
    full_state_dict,
    param_bytes,
    tp_loss,
    trace_tensor_parallel,
)
from paraloom.tensor_parallel.mappings import gather_from_region
from paraloom.topology import Topology
from paraloom.trace import Timeline, trace_modules
from paraloom.train.recipe import make_engine, make_model, make_optimizer
from paraloom.train.strategies import EngineStrategy, StepResult

EVAL_BATCH = 64


def flat_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for class logits (B, C) or token logits (B, T, V)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _median(values: list[float]) -> float:
    """The first steps warm up allocators and caches."""
    return statistics.median(values[2:] or values) if values else 0.0


class ModelParallelStrategy(EngineStrategy):
    """Tensor, pipeline and layer parallelism, and their hybrids with data parallelism."""

    drop_last = True

    def __init__(self, cfg: Config, split: Split, *, device: torch.device, timeline: Timeline | None) -> None:
        self.cfg, self.split, self.device = cfg, split, device
        world = dist.get_world_size()
        self.grid = cfg.grid(world)
        dp, tp, pp = self.grid
        self.groups = groups = Topology(dp=dp, tp=tp, pp=pp).init_groups()
        # metrics, the guard's flag, evaluation sums and checkpoints: a group of its own over every rank
        self.group = self.checkpoint_group = dist.new_group(list(range(world)), timeout=default_timeout())
        self.dp_rank, self.dp_world_size = groups.dp_rank, dp
        self.first, self.last = groups.pp_is_first_stage, groups.pp_is_last_stage
        self.m = 1 if cfg.parallel.mode == "layers" else cfg.parallel.microbatches
        self.schedule = "layers" if cfg.parallel.mode == "layers" else cfg.parallel.schedule
        self.model = self._place(split, device)
        if timeline is not None:
            trace_modules(self.model, timeline)
            trace_tensor_parallel(self.model, timeline)
        self.loss_fn = (lambda out, y: tp_loss(out, y, groups.tp_group)) if tp > 1 else flat_loss
        self.stats = CommStats()
        comm_group = None
        if cfg.comm.scheduler == "priority":  # its collectives get a twin of the dp group, made on every rank
            for ranks in groups.topology.groups("dp"):
                twin = dist.new_group(ranks, timeout=default_timeout())
                comm_group = twin if groups.rank in ranks else comm_group
        self.engine = make_engine(self.model, cfg.comm, groups, self.stats, timeline, cfg.optim,
                                  comm_group=comm_group)
        if cfg.guard.nan:  # every rank of the grid skips alike: the flag is all-reduced over all of them
            self.engine.guard_nonfinite(group=dist.new_group(list(range(world)), timeout=default_timeout()))
        self.optimizer = make_optimizer(cfg.optim, self.model.parameters(), cfg.comm)
        self.stage = PipelineStage(self.engine, pp_group=groups.pp_group,
                                   loss_fn=self.loss_fn if self.last else None,
                                   static_shapes=True, timeline=timeline)  # every step's micro-batches alike
        self.step_seconds: list[float] = []
        self.peak_activation = 0

    def _place(self, split: Split, device: torch.device) -> nn.Module:
        """Build the whole model, keep this rank's stage, split it over the tp group."""
        cfg, (dp, tp, pp) = self.cfg, self.grid
        full = make_model(cfg, split)
        if not isinstance(full, nn.Sequential):
            raise UserError(f"model.name={cfg.model.name} is not a sequence of pieces; pipeline and "
                            "layer parallelism need one")
        if pp > len(full):
            raise UserError(f"{pp} pipeline stages exceed model.name={cfg.model.name}'s {len(full)} pieces; "
                            "lower parallel.pp or use a deeper model")
        per_replica = cfg.data.batch_size // dp
        sample = split.x_train[: per_replica // self.m]
        self.bounds = balance(list(full), pp, by=cfg.parallel.balance, sample=sample)
        # the whole model's keys and shapes, for gathering it into one state dict (save_model)
        self.full_shapes = {key: (value.shape, value.dtype) for key, value in full.state_dict().items()}
        module = stage_module(full, self.bounds, self.groups.pp_rank)
        if tp > 1:
            apply_tensor_parallel(module, self.groups.tp_group)
        return module.to(device)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, step: int,
                   saving: bool) -> StepResult:
        began = time.perf_counter()
        inputs = split_microbatches(x, self.m) if self.first else None
        targets = split_microbatches(y, self.m) if self.last else None
        loss, measured = self.stage.step(self.schedule, inputs, targets, n_microbatches=self.m,
                                         no_sync=self.engine.no_sync)
        stepped = self.engine.step(self.optimizer)
        self.step_seconds.append(time.perf_counter() - began)
        self.peak_activation = max(self.peak_activation, measured.peak_activation_bytes)
        return StepResult(stepped, loss, measured.busy_seconds)

    def loss_value(self, result: StepResult, global_count: int) -> float:
        """Mean over data-parallel replicas of the last stages' losses (tp rank 0 of each counts)."""
        reports = self.last and self.groups.tp_rank == 0
        t = torch.tensor([float(result.loss) if reports else 0.0], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t) / self.grid[0]

    def metrics(self) -> dict[str, Any]:
        return {"step_seconds": self.step_seconds[-1]} if self.step_seconds else {}

    def epoch_end(self) -> float:
        return self.evaluate()[1]

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(mean validation loss, accuracy per target) through the pipeline, forward only.

        Data-parallel replicas score disjoint slices; the first stage feeds, middle stages relay,
        the last stage scores (with tensor parallelism, the vocabulary-parallel logits are gathered
        for the argmax). The sums are all-reduced over every rank, counted once per replica.
        """
        split, groups = self.split, self.groups
        self.model.eval()
        x = split.x_test.tensor_split(self.dp_world_size)[self.dp_rank]
        y = split.y_test.tensor_split(self.dp_world_size)[self.dp_rank]
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, targets
        for xb, yb in zip(x.split(EVAL_BATCH), y.split(EVAL_BATCH), strict=True):
            out = self.stage.infer(xb if self.first else None, module=self.model)
            if out is None:
                continue
            n = yb.numel()
            sums[0] += float(self.loss_fn(out, yb)) * n
            logits = gather_from_region(out, groups.tp_group) if groups.tp_world_size > 1 else out
            sums[1] += int((logits.argmax(dim=-1) == yb).sum())
            sums[2] += n
        if not (self.last and groups.tp_rank == 0):
            sums.zero_()
        dist.all_reduce(sums, group=self.group)
        self.model.train()
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    def finish(self) -> dict[str, Any]:
        self.engine.finish()
        val_loss, accuracy = self.evaluate()
        results = {"test_accuracy": accuracy, "val_loss": val_loss}
        if self.cfg.data.name == "text":
            from paraloom.data.text import unigram_loss

            results["unigram_loss"] = unigram_loss(self.split)
        return results

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on global rank 0: each stage's tp shards gathered in its tp group, then
        dp rank 0 / tp rank 0 of every stage sends its stage to rank 0 (collective)."""
        groups = self.groups
        mine = full_state_dict(self.model, groups.tp_group) if groups.tp_world_size > 1 else \
            self.model.state_dict()
        sources = [groups.topology.rank(pp=stage, dp=0, tp=0) for stage in range(self.grid[2])]
        return gather_stages(mine, self.bounds, groups.pp_rank, self.full_shapes,
                             sender=groups.dp_rank == 0 and groups.tp_rank == 0, source_of=sources)

    def state_dict(self) -> dict[str, Any]:
        return {"grid": list(self.grid), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "engine": self.engine.comm_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("grid") != list(self.grid):
            raise UserError(f"the checkpoint was written by a dp x tp x pp = {state.get('grid')} grid; "
                            f"this run is {list(self.grid)}: resume on the same grid")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "engine" in state:
            self.engine.load_comm_state_dict(state["engine"])

    def summary(self) -> dict[str, Any]:
        """Step and schedule times, bubbles, memory and partition, every rank's (collective)."""
        history = self.stage.history
        per_rank = gather_floats([_median(self.step_seconds), _median([h.busy_seconds for h in history]),
                                  _median([h.step_seconds for h in history]), float(param_bytes(self.model)),
                                  float(self.peak_activation)], self.group)
        dp, tp, pp = self.grid
        return {"grid": {"dp": dp, "tp": tp, "pp": pp}, "schedule": self.schedule, "microbatches": self.m,
                "partition": [list(b) for b in self.bounds], **bubbles(per_rank[:, :3], pp, self.m),
                "param_bytes_per_rank": [int(b) for b in per_rank[:, 3].tolist()],
                "activation_peak_bytes_per_rank": [int(b) for b in per_rank[:, 4].tolist()]}

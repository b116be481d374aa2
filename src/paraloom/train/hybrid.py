"""Model-parallel training: a dp x tp x pp grid of ranks, each holding one stage's tensor-parallel shard.

Every rank builds the whole model from the seed, keeps pipeline stage `pp_rank`'s contiguous
slice of its pieces (balanced by parameters, or by time profiled on rank 0), splits that slice
across its tensor-parallel group, and wraps it in the data-parallel engine over its dp group.
A step cuts the replica's batch into `parallel.microbatches` and runs the pipeline schedule
(`layers` mode: one micro-batch, no overlap); the engine then averages gradients over dp and
updates. Partial last batches are dropped, so every step has the same micro-batch sizes.
Checkpoints are per rank (each holds its own shard) and resume on the same grid.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.comm.collectives import CommStats, default_timeout
from paraloom.config import Config
from paraloom.data import ShardedBatches, Split, load_dataset
from paraloom.errors import UserError
from paraloom.models import build_model
from paraloom.pipeline_parallel import PipelineStage, balance_by_params, balance_by_time, bubble_fraction
from paraloom.pipeline_parallel.partition import stage_module
from paraloom.pipeline_parallel.runtime import split_microbatches
from paraloom.tensor_parallel import apply_tensor_parallel, param_bytes, tp_loss
from paraloom.tensor_parallel.mappings import gather_from_region
from paraloom.topology import RankGroups, Topology, node_count
from paraloom.train.checkpoint import agree_on_checkpoint, load_checkpoint, save_checkpoint
from paraloom.train.metrics import MetricsLogger, write_json
from paraloom.train.progress import TrainProgress
from paraloom.train.trainer import make_engine, make_optimizer, planned_steps, shared_run_dir

EVAL_BATCH = 64


def flat_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for class logits (B, C) or token logits (B, T, V)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (Linux VmHWM; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def profile_pieces(pieces: list[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward plus backward seconds of each piece on `sample` (median of `repeats`)."""
    costs: list[list[float]] = [[] for _ in pieces]
    for _ in range(repeats):
        h = sample
        for i, piece in enumerate(pieces):
            x = h.detach().requires_grad_(h.is_floating_point())
            began = time.perf_counter()
            out = piece(x)
            out.backward(torch.ones_like(out))
            costs[i].append(time.perf_counter() - began)
            h = out.detach()
    for piece in pieces:
        piece.zero_grad(set_to_none=True)
    return [statistics.median(c) for c in costs]


def partition(cfg: Config, pieces: list[nn.Module], pp: int, sample: torch.Tensor) -> list[tuple[int, int]]:
    """Stage bounds; by time, rank 0 profiles and every rank takes its bounds (one source of truth)."""
    if cfg.parallel.balance == "params" or pp == 1:
        return balance_by_params(pieces, pp)
    bounds = torch.zeros(pp, 2, dtype=torch.int64)
    if dist.get_rank() == 0:
        bounds[:] = torch.tensor(balance_by_time(profile_pieces(pieces, sample), pp))
    dist.broadcast(bounds, src=0)
    return [tuple(b) for b in bounds.tolist()]


class StagePlace:
    """This rank's place in its pipeline: first or last stage, its neighbours' ranks, its groups."""

    def __init__(self, groups: RankGroups, world_group: dist.ProcessGroup) -> None:
        self.groups, self.world_group = groups, world_group
        self.first, self.last = groups.pp_is_first_stage, groups.pp_is_last_stage
        self.prev = groups.rank - groups.topology.dp * groups.topology.tp if not self.first else None
        self.next = groups.rank + groups.topology.dp * groups.topology.tp if not self.last else None

    def reports_loss(self) -> bool:
        """One rank per replica holds each replica's loss: the last stage's tp rank 0."""
        return self.last and self.groups.tp_rank == 0

    def replica_mean(self, value: float) -> float:
        """Mean over data-parallel replicas of a value known on `reports_loss` ranks (collective)."""
        t = torch.tensor([value if self.reports_loss() else 0.0], dtype=torch.float64)
        dist.all_reduce(t, group=self.world_group)
        return float(t) / self.groups.topology.dp


def _send(t: torch.Tensor, dst: int) -> None:
    header = torch.zeros(8, dtype=torch.int64)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape)
    dist.send(header, dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, dtype: torch.dtype) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64)
    dist.recv(header, src)
    out = torch.empty(header[1:1 + int(header[0])].tolist(), dtype=dtype)
    dist.recv(out, src)
    return out


@torch.no_grad()
def evaluate_pipeline(module: nn.Module, split: Split, place: StagePlace, loss_fn) -> tuple[float, float]:
    """(mean validation loss, accuracy per target) through the pipeline, forward only.

    Data-parallel replicas score disjoint slices; the first stage feeds, middle stages relay,
    the last stage scores (with tensor parallelism, the vocabulary-parallel logits are gathered
    for the argmax). The sums are all-reduced over every rank, counted once per replica.
    """
    groups = place.groups
    module.eval()
    x = split.x_test.tensor_split(groups.dp_world_size)[groups.dp_rank]
    y = split.y_test.tensor_split(groups.dp_world_size)[groups.dp_rank]
    dtype = next(module.parameters()).dtype
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, targets
    for xb, yb in zip(x.split(EVAL_BATCH), y.split(EVAL_BATCH), strict=True):
        h = xb if place.first else _recv(place.prev, dtype)
        out = module(h)
        if not place.last:
            _send(out, place.next)
            continue
        n = yb.numel()
        sums[0] += float(loss_fn(out, yb)) * n
        logits = gather_from_region(out, groups.tp_group) if groups.tp_world_size > 1 else out
        sums[1] += int((logits.argmax(dim=-1) == yb).sum())
        sums[2] += n
    if not place.reports_loss():
        sums.zero_()
    dist.all_reduce(sums, group=place.world_group)
    module.train()
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def train_model_parallel(cfg: Config, run_dir: Path | None, *, device: torch.device,
                         started_at: float | None = None) -> dict[str, Any]:
    """One rank of a tensor-, pipeline- or layer-parallel run (possibly with data parallelism)."""
    started_at = time.time() if started_at is None else started_at
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    dp, tp, pp = cfg.grid(world)
    groups = Topology(dp=dp, tp=tp, pp=pp).init_groups()
    world_group = dist.new_group(list(range(world)), timeout=default_timeout())  # metrics, guard, eval sums
    place = StagePlace(groups, world_group)
    torch.manual_seed(cfg.run.seed)
    run_dir = shared_run_dir(run_dir)

    data_kwargs = dataclasses.asdict(cfg.data)
    split = load_dataset(data_kwargs.pop("name"), **data_kwargs).to(device)
    model_kwargs = dataclasses.asdict(cfg.model)
    full = build_model(model_kwargs.pop("name"), split.input_shape, split.n_classes, **model_kwargs)
    if not isinstance(full, nn.Sequential):
        raise UserError(f"model.name={cfg.model.name} is not a sequence of pieces; pipeline and "
                        "layer parallelism need one")
    pieces = list(full)
    if pp > len(pieces):
        raise UserError(f"{pp} pipeline stages exceed model.name={cfg.model.name}'s {len(pieces)} pieces; "
                        "lower parallel.pp or use a deeper model")
    m = 1 if cfg.parallel.mode == "layers" else cfg.parallel.microbatches
    per_replica = cfg.data.batch_size // dp
    bounds = partition(cfg, pieces, pp, split.x_train[: per_replica // m])
    module = stage_module(full, bounds, groups.pp_rank)
    del full, pieces
    if tp > 1:
        apply_tensor_parallel(module, groups.tp_group)
    module.to(device)
    loss_fn = (lambda out, y: tp_loss(out, y, groups.tp_group)) if tp > 1 else flat_loss

    stats = CommStats()
    comm_group = None
    if cfg.comm.scheduler == "priority":  # its collectives get a twin of the dp group, made on every rank
        for ranks in groups.topology.groups("dp"):
            twin = dist.new_group(ranks, timeout=default_timeout())
            comm_group = twin if rank in ranks else comm_group
    engine = make_engine(module, cfg.comm, groups, stats, None, cfg.optim, comm_group=comm_group)
    if cfg.guard.nan:
        engine.guard_nonfinite(group=dist.new_group(list(range(world)), timeout=default_timeout()))
    stats.take()
    optimizer = make_optimizer(cfg.optim, module.parameters(), cfg.comm)
    stage = PipelineStage(engine, pp_group=groups.pp_group, loss_fn=loss_fn if place.last else None,
                          static_shapes=True)  # every step's micro-batches have the same shapes
    schedule = "layers" if cfg.parallel.mode == "layers" else cfg.parallel.schedule
    batches = ShardedBatches(len(split.y_train), cfg.data.batch_size, rank=groups.dp_rank, world=dp,
                             seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    total_steps = planned_steps(cfg, len(split.y_train) // cfg.data.batch_size * cfg.data.batch_size)

    step, samples, skipped = 0, 0, 0
    resumed = agree_on_checkpoint(run_dir)
    if resumed is not None:
        _, local = load_checkpoint(run_dir, resumed, rank, device)
        if local.get("grid") != [dp, tp, pp]:
            raise UserError(f"the checkpoint at step {resumed} was written by a dp x tp x pp = "
                            f"{local.get('grid')} grid; this run is {[dp, tp, pp]}: resume on the same grid")
        module.load_state_dict(local["model"])
        optimizer.load_state_dict(local["optimizer"])
        torch.set_rng_state(local["rng"].cpu())
        step, samples = int(local["step"]), int(local["samples"])
        if is_main:
            print(f"paraloom: resuming from checkpoint step {step} of {total_steps}", file=sys.stderr)

    def checkpoint() -> None:
        local = {"grid": [dp, tp, pp], "step": step, "samples": samples, "model": module.state_dict(),
                 "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
        save_checkpoint(run_dir, step, local=local, shared=None, keep=cfg.run.keep_checkpoints)

    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) if is_main and run_dir else None
    progress = TrainProgress(total_steps, enabled=is_main)
    step_seconds: list[float] = []
    busy: list[float] = []  # per step: the pipeline's compute seconds on this rank
    pipelined: list[float] = []  # per step: the pipeline schedule's seconds (no optimizer step)
    peak_activation = 0
    loss_value = None
    loop_start, samples_at_start = time.perf_counter(), samples
    try:
        per_epoch = len(split.y_train) // cfg.data.batch_size  # full batches: the short last one is dropped
        while step < total_steps:
            epoch = step // per_epoch
            # from the resumed position: a resumed run takes the batches a straight run would
            for local_idx, global_count in itertools.islice(batches.epoch(epoch), step % per_epoch, None):
                if global_count < cfg.data.batch_size:
                    continue  # the partial last batch: micro-batches stay the same size
                if step == total_steps:
                    break
                began = time.perf_counter()
                local_idx = local_idx.to(device)
                inputs = split_microbatches(split.x_train[local_idx], m) if place.first else None
                targets = split_microbatches(split.y_train[local_idx], m) if place.last else None
                loss, measured = stage.step(schedule, inputs, targets, n_microbatches=m,
                                            no_sync=engine.no_sync)
                if not engine.step(optimizer):
                    skipped += 1
                step += 1
                samples += cfg.data.batch_size
                step_seconds.append(time.perf_counter() - began)
                busy.append(measured.busy_seconds)
                pipelined.append(measured.step_seconds)
                peak_activation = max(peak_activation, measured.peak_activation_bytes)
                if step % cfg.run.log_every == 0 or step == total_steps:
                    loss_value = place.replica_mean(float(loss) if loss is not None else 0.0)
                    if logger is not None:
                        logger.log({"step": step, "epoch": epoch, "loss": loss_value,
                                    "step_seconds": step_seconds[-1], "skipped_steps": skipped})
                if run_dir is not None and cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0 \
                        and step < total_steps:
                    checkpoint()
                progress.update(step, loss=loss_value, epoch=epoch,
                                samples_per_s=(samples - samples_at_start) / max(time.perf_counter()
                                                                                 - loop_start, 1e-9))
        train_seconds = time.perf_counter() - loop_start
        val_loss, accuracy = evaluate_pipeline(module, split, place, loss_fn)
        if run_dir is not None and resumed != step:
            checkpoint()
    finally:
        engine.close()
        progress.close()
        if logger is not None:
            logger.close()

    def median(values: list[float]) -> float:  # the first steps warm up allocators and caches
        return statistics.median(values[2:] or values) if values else 0.0

    mine = torch.tensor([median(step_seconds), median(busy), median(pipelined),
                         float(param_bytes(module)), float(peak_activation), peak_rss_mb()],
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=world_group)
    per_rank = torch.stack(every)
    step_s = float(per_rank[:, 0].max())  # a step is done when the slowest rank is
    summary = {
        "val_loss": val_loss,
        "test_accuracy": accuracy,
        "final_loss": loss_value,
        "steps": step,
        "epochs": cfg.optim.epochs,
        "samples": samples,
        "world_size": world,
        "nodes": node_count(world),  # hosts or emulated nodes: which link the run used
        "grid": {"dp": dp, "tp": tp, "pp": pp},
        "schedule": schedule,
        "microbatches": m,
        "partition": [list(b) for b in bounds],
        "wall_seconds": time.time() - started_at,
        "train_seconds": train_seconds,
        "samples_per_second": (samples - samples_at_start) / train_seconds if train_seconds > 0 else 0.0,
        "step_seconds": step_s,
        "step_seconds_per_rank": per_rank[:, 0].tolist(),
        "schedule_seconds_per_rank": per_rank[:, 2].tolist(),  # the pipeline schedule alone
        # the share of the schedule's time a rank did not compute (the optimizer step excluded)
        "bubble_per_rank": [1 - b / s if s > 0 else 0.0 for b, s in per_rank[:, 1:3].tolist()],
        # the whole pipeline's: idle share of all ranks' time over the slowest rank's schedule time
        "bubble": 1 - float(per_rank[:, 1].mean() / per_rank[:, 2].max()) if step > 0 else 0.0,
        # the bottleneck stage's (most compute): fill and drain, without the others' load imbalance
        "bubble_bottleneck": 1 - float(per_rank[:, 1].max() / per_rank[:, 2].max()) if step > 0 else 0.0,
        "bubble_theory": bubble_fraction(pp, m) if pp > 1 else 0.0,
        "param_bytes_per_rank": [int(b) for b in per_rank[:, 3].tolist()],
        "activation_peak_bytes_per_rank": [int(b) for b in per_rank[:, 4].tolist()],
        "rss_peak_mb_per_rank": per_rank[:, 5].tolist(),
        "comm_bytes_per_step": stats.bytes / max(step, 1),
        "skipped_steps": skipped,
        "device": str(device),
        "backend": dist.get_backend(),
    }
    if cfg.data.name == "text":
        from paraloom.data.text import unigram_loss

        summary["unigram_loss"] = unigram_loss(split)
    if is_main and run_dir is not None:
        write_json(run_dir / "summary.json", summary)
    return summary

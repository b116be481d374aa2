"""The training loop one rank runs: data shard, model, data-parallel sync, metrics, summary."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.comm.collectives import CommStats
from paraloom.config import CommConfig, Config, OptimConfig
from paraloom.data import ShardedBatches, Split, load_dataset
from paraloom.data_parallel import DataParallel, DataParallelNaive
from paraloom.errors import UserError
from paraloom.models import build_model
from paraloom.topology import RankGroups, Topology
from paraloom.trace import Timeline, trace_modules
from paraloom.train.metrics import MetricsLogger, save_state, write_json
from paraloom.train.progress import TrainProgress


def make_engine(model: nn.Module, comm: CommConfig, groups: RankGroups, stats: CommStats, timeline=None,
                optim: OptimConfig | None = None) -> DataParallel | DataParallelNaive:
    if comm.engine == "naive":
        return DataParallelNaive(model, group=groups.dp_group, algorithm=comm.algorithm, stats=stats)
    options = dgc_options(comm, optim) if optim is not None else None
    return DataParallel(model, topology=groups, comm=comm, stats=stats, timeline=timeline,
                        compressor_options=options)


def dgc_options(comm: CommConfig, optim: OptimConfig) -> dict[str, float] | None:
    """DGC's momentum correction replaces the optimizer's momentum (Lin et al. 2018): with SGD the
    compressor takes optim.momentum and the optimizer runs without it; Adam keeps its own moments,
    so DGC runs without momentum correction (sampled top-k with error feedback)."""
    if comm.compressor != "dgc":
        return None
    return {"momentum": optim.momentum if optim.name == "sgd" else 0.0}


def make_optimizer(cfg: OptimConfig, params, comm: CommConfig | None = None) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        momentum = 0.0 if comm is not None and comm.compressor == "dgc" else cfg.momentum  # see dgc_options
        return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, global_count: int,
               dp_world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, summed loss of this shard).

    The back-propagated loss is sum / global_count * dp_world_size, so that averaging gradients
    over the data-parallel group gives exactly the gradient of the global batch's mean loss,
    even when the last batch of an epoch splits unevenly (see data/sharding.py).
    """
    loss_sum = F.cross_entropy(model(x), y, reduction="sum")
    return loss_sum * (dp_world_size / global_count), loss_sum.detach()


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, groups: RankGroups, batch: int = 1024) -> float:
    """Test accuracy; each data-parallel rank scores a slice and the counts are summed."""
    model.eval()
    x = split.x_test.tensor_split(groups.dp_world_size)[groups.dp_rank]
    y = split.y_test.tensor_split(groups.dp_world_size)[groups.dp_rank]
    correct = torch.zeros((), dtype=torch.float64, device=split.x_test.device)
    for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
        correct += (model(xb).argmax(dim=1) == yb).sum()
    dist.all_reduce(correct, group=groups.dp_group)
    model.train()
    return float(correct) / len(split.y_test)


def shared_run_dir(run_dir: Path | None) -> Path | None:
    """Global rank 0's run directory, on every rank (under torchrun only rank 0 is given it)."""
    box = [str(run_dir.resolve()) if run_dir is not None and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


def train(cfg: Config, run_dir: Path | None, *, device: torch.device,
          started_at: float | None = None) -> dict[str, Any]:
    """Run the whole job on this rank; rank 0 writes the run directory and returns the summary."""
    started_at = time.time() if started_at is None else started_at
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    groups = Topology.for_world(world).init_groups()
    torch.manual_seed(cfg.run.seed)

    data_kwargs = dataclasses.asdict(cfg.data)
    split = load_dataset(data_kwargs.pop("name"), **data_kwargs).to(device)
    model_kwargs = dataclasses.asdict(cfg.model)
    model = build_model(model_kwargs.pop("name"), split.input_shape, split.n_classes,
                        **model_kwargs).to(device)
    timeline = None
    if cfg.run.trace:
        trace_dir = shared_run_dir(run_dir)
        if trace_dir is None:
            raise UserError("run.trace=true needs a run directory; give train() one on rank 0")
        trace_dir = trace_dir / "trace"
        timeline = Timeline(rank)
        trace_modules(model, timeline)  # the bare model: its layers, not the engine's wrapper
    stats = CommStats()
    engine = make_engine(model, cfg.comm, groups, stats, timeline, cfg.optim)
    stats.take()  # the initial broadcast is not a training step's traffic
    optimizer = make_optimizer(cfg.optim, model.parameters(), cfg.comm)
    batches = ShardedBatches(len(split.y_train), cfg.data.batch_size, rank=groups.dp_rank,
                             world=groups.dp_world_size, seed=cfg.run.seed,
                             shuffle=cfg.data.shuffle)
    total_steps = cfg.optim.epochs * len(batches)
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)

    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) if is_main and run_dir else None
    progress = TrainProgress(total_steps, enabled=is_main)
    step, samples, comm_bytes_total, comm_seconds_total = 0, 0, 0, 0.0
    logged_step, logged_samples, logged_at = 0, 0, time.perf_counter()
    loss_value: float | None = None
    loop_start = time.perf_counter()
    try:
        for epoch in range(cfg.optim.epochs):
            for local_idx, global_count in batches.epoch(epoch):
                if step == total_steps:
                    break
                if timeline is not None:  # steps 2 .. 1 + trace_steps (1-based)
                    timeline.active = 1 <= step <= cfg.run.trace_steps
                    step_start = timeline.now()
                local_idx = local_idx.to(device)
                x, y = split.x_train[local_idx], split.y_train[local_idx]
                loss, loss_sum = batch_loss(engine, x, y, global_count=global_count,
                                            dp_world_size=groups.dp_world_size)
                loss.backward()
                engine.step(optimizer)  # synchronize, update, zero the gradients (bucket views)
                step += 1
                if timeline is not None:
                    timeline.span(f"step {step}", "step", step_start, timeline.now())
                samples += global_count
                if step % cfg.run.log_every == 0 or step == total_steps:
                    dist.all_reduce(loss_sum, group=groups.dp_group)  # metric only, not counted
                    loss_value = float(loss_sum) / global_count
                    now = time.perf_counter()
                    rate = (samples - logged_samples) / max(now - logged_at, 1e-9)
                    comm = stats.take()
                    steps_since = step - logged_step
                    comm_bytes_total += comm.bytes
                    comm_seconds_total += comm.seconds
                    if logger is not None:
                        logger.log({"step": step, "epoch": epoch, "loss": loss_value,
                                    "lr": optimizer.param_groups[0]["lr"],
                                    "samples_per_s": rate,
                                    "comm_bytes": comm.bytes / steps_since,
                                    "comm_seconds": comm.seconds / steps_since})
                    logged_step, logged_samples, logged_at = step, samples, now
                progress.update(step, loss=loss_value,
                                samples_per_s=samples / max(time.perf_counter() - loop_start, 1e-9),
                                epoch=epoch)
        engine.finish()  # deferred updates and the last delayed all-reduce land before evaluating
        train_seconds = time.perf_counter() - loop_start
        if timeline is not None:
            timeline.active = False
        accuracy = evaluate(model, split, groups)
    finally:
        engine.close()
        progress.close()
        if logger is not None:
            logger.close()

    summary = {
        "test_accuracy": accuracy,
        "final_loss": loss_value,
        "steps": step,
        "epochs": cfg.optim.epochs,
        "samples": samples,
        "world_size": world,
        "wall_seconds": time.time() - started_at,
        "train_seconds": train_seconds,
        "samples_per_second": samples / train_seconds if train_seconds > 0 else 0.0,
        "comm_bytes_per_step": comm_bytes_total / max(step, 1),
        "comm_seconds_per_step": comm_seconds_total / max(step, 1),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "device": str(device),
        "backend": dist.get_backend(),
    }
    if timeline is not None:
        timeline.write(trace_dir / f"rank{rank}.json")  # every rank writes its own
        summary["trace_dir"] = str(trace_dir)
    if is_main and run_dir is not None:
        if cfg.run.save_model:
            save_state(run_dir / "model.pt", model.state_dict())
        write_json(run_dir / "summary.json", summary)
    return summary

"""`parallel.mode=ps`: the first ranks are workers, the last `ps.servers` ranks are servers.

Every rank builds the model from the same seed; server i keeps shard i of the flattened
parameters and runs the optimizer on it. Workers pull all shards, compute on their slice of the
global batch, push all shards' gradients. Worker 0 logs metrics and writes the summary, with
every server's counts (pushes applied, staleness histograms) and every worker's wait time.
Not yet here: checkpoints and compression of pushes (the data-parallel engine has both).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from paraloom.comm.collectives import default_timeout
from paraloom.config import Config
from paraloom.data import ShardedBatches, load_dataset
from paraloom.errors import UserError
from paraloom.models import build_model
from paraloom.parameter_server.consistency import staleness_bound
from paraloom.parameter_server.server import ParameterServer
from paraloom.parameter_server.shard import flatten_model, shard_bounds
from paraloom.parameter_server.worker import PSClient
from paraloom.train.faults import FaultInjector, parse_faults
from paraloom.train.metrics import MetricsLogger, save_state, write_json
from paraloom.train.progress import TrainProgress
from paraloom.train.trainer import (
    batch_loss,
    evaluate,
    local_accuracy,
    make_optimizer,
    planned_steps,
    shared_run_dir,
)


def train_ps(cfg: Config, run_dir: Path | None, *, device: torch.device,
             started_at: float | None = None) -> dict[str, Any]:
    started_at = time.time() if started_at is None else started_at
    if device.type != "cpu":
        raise UserError("parallel.mode=ps runs on CPU (gloo) so far; use run.device=cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_servers = cfg.ps.servers
    n_workers = world - n_servers
    if n_workers < 1:
        raise ValueError(f"{world} processes cannot hold {n_servers} servers and a worker")
    run_dir = shared_run_dir(run_dir)
    worker_group = dist.new_group(list(range(n_workers)), timeout=default_timeout())
    torch.manual_seed(cfg.run.seed)
    data_kwargs = dataclasses.asdict(cfg.data)
    split = load_dataset(data_kwargs.pop("name"), **data_kwargs)
    model_kwargs = dataclasses.asdict(cfg.model)
    model = build_model(model_kwargs.pop("name"), split.input_shape, split.n_classes, **model_kwargs)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bounds = shard_bounds(n_params, n_servers)
    servers = list(range(n_workers, world))

    if rank >= n_workers:
        flat, _ = flatten_model(model)
        lo, hi = bounds[rank - n_workers]
        server = ParameterServer(flat[lo:hi], lambda params: make_optimizer(cfg.optim, params),
                                 workers=list(range(n_workers)),
                                 bound=staleness_bound(cfg.ps.consistency, cfg.ps.staleness),
                                 average=cfg.ps.consistency == "bsp")
        stats = server.serve()
        if run_dir is not None:
            (run_dir / "ps").mkdir(exist_ok=True)
            write_json(run_dir / "ps" / f"server{rank - n_workers}.json", stats)
        dist.barrier()  # the summary is written after every server's counts are on disk
        return {"server": rank - n_workers, **stats}

    client = PSClient(model, servers, bounds)
    batches = ShardedBatches(len(split.y_train), cfg.data.batch_size, rank=rank, world=n_workers,
                             seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    total_steps = planned_steps(cfg, len(split.y_train))
    faults = FaultInjector(parse_faults(cfg.run.inject) if cfg.run.inject else [], rank=rank,
                           world_size=n_workers, seed=cfg.run.seed, run_dir=run_dir)
    is_main = rank == 0
    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) if is_main and run_dir else None
    progress = TrainProgress(total_steps, enabled=is_main)
    step, samples, loss_value = 0, 0, None
    epoch_accuracy: list[list[float]] = []  # [training seconds, test accuracy] after each epoch
    eval_seconds = 0.0
    loop_start = time.perf_counter()
    try:
        for epoch in range(cfg.optim.epochs):
            for local_idx, global_count in batches.epoch(epoch):
                if step == total_steps:
                    break
                client.pull()
                began = time.perf_counter()
                x, y = split.x_train[local_idx], split.y_train[local_idx]
                loss, loss_sum = batch_loss(model, x, y, global_count=global_count, dp_world_size=n_workers)
                loss.backward()
                slow = faults.slow_factor(step + 1)
                if slow > 1.0:
                    time.sleep((slow - 1.0) * (time.perf_counter() - began))
                client.push()
                step += 1
                samples += global_count
                if step % cfg.run.log_every == 0 or step == total_steps:
                    loss_value = float(loss_sum) / max(1, len(local_idx))  # this worker's slice
                    if logger is not None:
                        logger.log({"step": step, "epoch": epoch, "loss": loss_value,
                                    "samples_per_s": samples / max(time.perf_counter() - loop_start, 1e-9),
                                    "wait_seconds": client.wait_seconds})
                progress.update(step, loss=loss_value, epoch=epoch,
                                samples_per_s=samples / max(time.perf_counter() - loop_start, 1e-9))
            if cfg.run.eval_every_epoch and is_main and step > 0:  # worker 0's last pull, no communication
                began = time.perf_counter()
                epoch_accuracy.append([began - loop_start - eval_seconds, local_accuracy(model, split)])
                eval_seconds += time.perf_counter() - began
        client.pull()  # the servers' final parameters
        train_seconds = time.perf_counter() - loop_start - eval_seconds
        client.close()
        groups = SimpleNamespace(dp_group=worker_group, dp_rank=rank, dp_world_size=n_workers)
        accuracy = evaluate(model, split, groups)
        waits = [torch.zeros(1, dtype=torch.float64) for _ in range(n_workers)]
        dist.all_gather(waits, torch.tensor([client.wait_seconds], dtype=torch.float64), group=worker_group)
    finally:
        progress.close()
        if logger is not None:
            logger.close()
    dist.barrier()
    summary = {
        "test_accuracy": accuracy, "final_loss": loss_value, "steps": step, "epochs": cfg.optim.epochs,
        "samples": samples, "world_size": world, "workers": n_workers, "servers": n_servers,
        "consistency": cfg.ps.consistency, "staleness_bound": cfg.ps.staleness,
        "wall_seconds": time.time() - started_at, "train_seconds": train_seconds,
        "samples_per_second": samples / train_seconds if train_seconds > 0 else 0.0,
        "wait_seconds_per_worker": [float(w) for w in waits],
        "comm_bytes_per_step": 8.0 * sum(hi - lo for lo, hi in bounds),  # pull + push, fp32, per worker
        "comm_seconds_per_step": client.wait_seconds / max(step, 1),
        "epoch_accuracy": epoch_accuracy,
        "restarts": 0, "steps_redone": 0, "skipped_steps": 0, "checkpoint_seconds": 0.0,
        "device": str(device), "backend": dist.get_backend(),
    }
    if is_main and run_dir is not None:
        summary["servers_stats"] = [json.loads((run_dir / "ps" / f"server{i}.json").read_text())
                                    for i in range(n_servers)]
        if cfg.run.save_model:
            save_state(run_dir / "model.pt", model.state_dict())
        write_json(run_dir / "summary.json", summary)
    return summary

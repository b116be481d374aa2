"""`parallel.mode=ps`: the first ranks are workers, the last `ps.servers` ranks are servers.

Every rank builds the model from the same seed; server i keeps shard i of the flattened
parameters and runs the optimizer on it. Workers pull all shards, compute on their slice of the
global batch, push all shards' gradients. Worker 0 logs metrics and writes the summary, with
every server's counts (pushes applied, staleness histograms) and every worker's wait time.
Pushes are compressed with comm.compressor (the fixed-size ones, choices.FIXED_SIZE_COMPRESSORS); a request
carries a token of the run id, and servers refuse a worker whose token differs.
Not yet here: checkpoints (the data-parallel trainer has them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from paraloom.comm.collectives import default_timeout
from paraloom.config import Config
from paraloom.config_faults import parse_faults
from paraloom.data import ShardedBatches, load_dataset
from paraloom.errors import UserError
from paraloom.models import build_model
from paraloom.parameter_server.consistency import staleness_bound
from paraloom.parameter_server.message import PushCodec, run_token
from paraloom.parameter_server.server import ParameterServer, serve
from paraloom.parameter_server.shard import flatten_model, slice_layout
from paraloom.parameter_server.worker import PSClient
from paraloom.topology import node_count
from paraloom.train.faults import FaultInjector
from paraloom.train.metrics import MetricsLogger, save_state, write_json
from paraloom.train.progress import TrainProgress
from paraloom.train.trainer import (
    batch_loss,
    dgc_options,
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
    layout = slice_layout(n_params, n_servers, max(1, int(cfg.ps.partition_mb * 2**20 / 4)))  # fp32
    bounds = [(lo, hi) for _, lo, hi in layout]
    servers = [n_workers + server for server, _, _ in layout]  # the rank owning each slice
    env = os.environ  # the run id and attempt the elastic agent gave this process, and the run directory
    token = run_token("/".join([env.get("TORCHELASTIC_RUN_ID", "local"),
                                env.get("TORCHELASTIC_RESTART_COUNT", "0"), run_dir.name if run_dir else ""]))
    compressor = None if cfg.comm.compressor == "none" else cfg.comm.compressor
    options = {**cfg.comm.compressor_options(), **(dgc_options(cfg.comm, cfg.optim) or {})}
    codecs = [PushCodec(hi - lo, compressor, options) for lo, hi in bounds]

    if rank >= n_workers:
        flat, _ = flatten_model(model)
        mine = [i for i, owner in enumerate(servers) if owner == rank]
        stats = serve([ParameterServer(flat[bounds[i][0]:bounds[i][1]],
                                       lambda params: make_optimizer(cfg.optim, params, cfg.comm),
                                       workers=list(range(n_workers)),
                                       bound=staleness_bound(cfg.ps.consistency, cfg.ps.staleness),
                                       average=cfg.ps.consistency == "bsp", token=token, codec=codecs[i],
                                       slot=slot)
                       for slot, i in enumerate(mine)])
        if run_dir is not None:
            (run_dir / "ps").mkdir(exist_ok=True)
            write_json(run_dir / "ps" / f"server{rank - n_workers}.json", stats)
        dist.barrier()  # the summary is written after every server's counts are on disk
        return {"server": rank - n_workers, **stats}

    client = PSClient(model, servers, bounds, token=token, codecs=codecs)
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
    snapshots: list[tuple[float, torch.Tensor]] = []  # (training seconds, parameters) after each epoch
    eval_seconds = 0.0
    client.pull()  # the initial parameters; waits for every server to be up
    if cfg.ps.overlap:
        client.attach(model)
    startup_wait, client.wait_seconds = client.wait_seconds, 0.0
    loop_start, cpu_start = time.perf_counter(), time.process_time()
    timeline = [(time.time(), 0.0)]  # (wall clock, this worker's samples) at the start and after each step
    try:
        for epoch in range(cfg.optim.epochs):
            for local_idx, global_count in batches.epoch(epoch):
                if step == total_steps:
                    break
                began, waited = time.perf_counter(), client.wait_seconds
                x, y = split.x_train[local_idx], split.y_train[local_idx]
                loss, loss_sum = batch_loss(model, x, y, global_count=global_count, dp_world_size=n_workers)
                # a straggler computes longer; waiting for replies (in forward, with overlap) is not computing
                slept = faults.stretch(step + 1, time.perf_counter() - began - (client.wait_seconds - waited))
                loss.backward()  # with overlap, each shard's push leaves from here
                faults.computed(time.perf_counter() - began - (client.wait_seconds - waited) - slept)
                client.push()
                if not cfg.ps.overlap:  # else forward loads each shard when it first needs it
                    client.pull()  # the parameters of the next step, as the consistency rule allows
                timeline.append((time.time(), float(len(local_idx))))
                step += 1
                samples += global_count
                if step % cfg.run.log_every == 0 or step == total_steps:
                    loss_value = float(loss_sum) / max(1, len(local_idx))  # this worker's slice
                    if logger is not None:
                        logger.log({"step": step, "epoch": epoch, "loss": loss_value,
                                    "samples_per_s": samples / max(time.perf_counter() - loop_start, 1e-9),
                                    "wait_seconds": client.wait_seconds, "wire_bytes": client.wire_bytes,
                                    "read_staleness": dict(sorted(client.read_staleness.items()))})
                        client.read_staleness.clear()  # a histogram per logged interval
                progress.update(step, loss=loss_value, epoch=epoch,
                                samples_per_s=samples / max(time.perf_counter() - loop_start, 1e-9))
            if cfg.run.eval_every_epoch and is_main and step > 0:
                # evaluated after training, so that no worker pauses (under ASP the others would not)
                client.settle()  # this epoch's last replies, waited for as training time
                began = time.perf_counter()
                snapshots.append((began - loop_start - eval_seconds, client.flat.clone()))
                eval_seconds += time.perf_counter() - began
        train_seconds = time.perf_counter() - loop_start - eval_seconds
        cpu_seconds = time.process_time() - cpu_start
        client.settle()
        with torch.no_grad():
            for seconds, flat in snapshots:
                client.flat.copy_(flat)
                epoch_accuracy.append([seconds, local_accuracy(model, split)])
        dist.barrier(group=worker_group)  # every worker's last push is applied: read the final state
        client.pull(fresh=True)
        client.close()
        groups = SimpleNamespace(dp_group=worker_group, dp_rank=rank, dp_world_size=n_workers)
        accuracy = evaluate(model, split, groups)
        waits = [torch.zeros(2, dtype=torch.float64) for _ in range(n_workers)]
        dist.all_gather(waits, torch.tensor([client.wait_seconds, cpu_seconds],
                                            dtype=torch.float64), group=worker_group)
        timelines = [torch.zeros(len(timeline), 2, dtype=torch.float64) for _ in range(n_workers)]
        dist.all_gather(timelines, torch.tensor(timeline, dtype=torch.float64), group=worker_group)
    finally:
        progress.close()
        if logger is not None:
            logger.close()
    dist.barrier()
    summary = {
        "test_accuracy": accuracy, "final_loss": loss_value, "steps": step, "epochs": cfg.optim.epochs,
        "samples": samples, "world_size": world, "workers": n_workers, "servers": n_servers,
        "nodes": node_count(world),  # hosts or emulated nodes: which link the run used
        "consistency": cfg.ps.consistency, "staleness_bound": cfg.ps.staleness,
        "wall_seconds": time.time() - started_at, "train_seconds": train_seconds,
        "samples_per_second": all_workers_throughput(timelines),
        "worker0_samples_per_second": samples / train_seconds if train_seconds > 0 else 0.0,
        "wait_seconds_per_worker": [float(w[0]) for w in waits],
        "cpu_seconds_per_worker": [float(w[1]) for w in waits],
        "startup_wait_seconds": startup_wait,  # worker 0's first read (servers starting); not training
        "comm_bytes_per_step": client.wire_bytes / max(step, 1) + 4.0 * sum(hi - lo for lo, hi in bounds),
        "push_bytes_per_step": client.wire_bytes / max(step, 1),  # per worker, headers included
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


def all_workers_throughput(timelines: list[torch.Tensor]) -> float:
    """Samples per second of all workers together while all of them were training: from the last
    worker's start to the first worker's finish, every worker's samples in that window. Under BSP
    this is the usual figure; under ASP it does not credit the fast workers' early finish, nor
    charge the straggler's lone tail, to the throughput of the whole.

    Each timeline is (wall clock, samples) rows: the start, then one row per step.
    """
    start = max(float(t[0, 0]) for t in timelines)
    end = min(float(t[-1, 0]) for t in timelines)
    if end <= start:
        return 0.0
    done = sum(float(t[1:, 1][(t[1:, 0] > start) & (t[1:, 0] <= end)].sum()) for t in timelines)
    return done / (end - start)

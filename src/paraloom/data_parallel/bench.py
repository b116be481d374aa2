"""Step-time benchmark of data-parallel engines against torch DDP, in one process group.

Every variant trains the same model from the same seed on the same digits shards; per variant
`warmup` steps are dropped and the median of the slowest rank's step time is kept. Alongside:
the pure compute time of a step (no communication) and the time of one native all-reduce of
all gradients, whose maximum is the physical bound for a synchronous step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

VARIANTS = ("ddp", "ddp_view", "fifo", "wait_free")  # ddp_view: DDP with gradient_as_bucket_view


def _model(hidden: int, depth: int):
    from paraloom.models import MLP

    return MLP((1, 8, 8), 10, hidden=hidden, depth=depth)


def measure(options: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paraloom.data import ShardedBatches, load_dataset
    from paraloom.data_parallel import DataParallel

    if options.get("interface"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", options["interface"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    split = load_dataset("digits")
    batches = ShardedBatches(len(split.y_train), options["batch"], rank=rank, world=world, seed=0)
    order = [idx for e in range(100) for idx, _ in batches.epoch(e)][: options["warmup"] + options["steps"]]

    def timed(step_fn) -> list[float]:
        times = []
        for idx in order:
            dist.barrier()
            start = time.perf_counter()
            step_fn(split.x_train[idx], split.y_train[idx])
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times[options["warmup"]:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.tolist()

    samples: dict[str, list[float]] = {}
    torch.manual_seed(0)
    model = _model(options["hidden"], options["depth"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def local_step(x, y):
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    samples["compute"] = timed(local_step)
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    samples["allreduce"] = timed(lambda x, y: dist.all_reduce(grads))
    n_params = grads.numel()
    # variants take turns, round after round, so a drifting machine favours none of them
    for variant in [v for _ in range(options["rounds"]) for v in options["variants"]]:
        torch.manual_seed(0)
        model = _model(options["hidden"], options["depth"])
        if variant.startswith("ddp"):
            engine = DDP(model, bucket_cap_mb=options["bucket_mb"],
                         gradient_as_bucket_view=variant == "ddp_view")
            sync = None
        else:
            engine = DataParallel(model, scheduler=variant, bucket_mb=options["bucket_mb"])
            sync = engine.sync_gradients
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(x, y, engine=engine, sync=sync, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(engine(x), y).backward()
            if sync is not None:
                sync()
            optimizer.step()

        samples.setdefault(variant, []).extend(timed(step))
        if not variant.startswith("ddp"):
            engine.close()
    results = {name: statistics.median(times) for name, times in samples.items()}
    if rank == 0:
        Path(options["results_path"]).write_text(json.dumps(
            {"world_size": world, "params": n_params, "seconds": results}))
    dist.destroy_process_group()


def run(*, cluster=None, nproc: int = 2, hidden: int = 2048, depth: int = 3, batch: int = 64,
        steps: int = 10, warmup: int = 3, rounds: int = 2, bucket_mb: float = 25.0,
        variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    import tempfile

    from paraloom.cluster.launch import torchrun_on_cluster
    from paraloom.launch import elastic_run

    with tempfile.TemporaryDirectory(prefix="paraloom-dpbench-") as tmp:
        options = {"hidden": hidden, "depth": depth, "batch": batch, "steps": steps, "warmup": warmup,
                   "rounds": rounds, "bucket_mb": bucket_mb, "variants": list(variants),
                   "results_path": str(Path(tmp) / "r.json"), "interface": None if cluster else "lo"}
        if cluster is not None:
            torchrun_on_cluster(cluster, ["paraloom.data_parallel.bench", "--options", json.dumps(options)],
                                log_dir=Path(tmp))
        else:
            elastic_run(measure, (options,), nproc=nproc)
        out = json.loads(Path(options["results_path"]).read_text())
    seconds = out["seconds"]
    out["bound"] = max(seconds["compute"], seconds["allreduce"])
    out["ratio_vs_ddp"] = {v: seconds[v] / seconds["ddp"] for v in variants if "ddp" in seconds}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paraloom.data_parallel.bench")
    parser.add_argument("--options", required=True)
    measure(json.loads(parser.parse_args(argv).options))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time and overlap of DataParallel under torch.compile (inductor): the benchmark's worker."""

from __future__ import annotations

import statistics
import time
from typing import Any

PLACEMENTS = ("eager", "compiled_inside", "compiled_outside")


def measure(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank: every placement in turn; median step time and overlap window after warm-up."""
    import torch
    import torch.distributed as dist

    from paraloom import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    width, depth = options["width"], options["depth"]
    out = {}
    caps = {"bucket_cap_mb": options["bucket_mb"], "first_bucket_mb": options["bucket_mb"]}
    for placement in PLACEMENTS:
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
        if placement == "compiled_inside":
            compiled = torch.compile(net, backend="inductor")
            engine = model = DataParallel(compiled, **caps)
        else:
            engine = model = DataParallel(net, **caps)
            if placement == "compiled_outside":
                model = torch.compile(engine, backend="inductor")
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(options["batch"], width, generator=gen)
        y = torch.randint(0, 10, (options["batch"],), generator=gen)
        steps, windows = [], []
        for step in range(options["warmup"] + options["steps"]):
            start = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if step >= options["warmup"]:
                steps.append(time.perf_counter() - start)
                ready = sorted(engine.ready_at.values())
                windows.append((ready[-1] - ready[0]) / ready[-1] if ready[-1] > 0 else 0.0)
        engine.close()
        seconds = torch.tensor(statistics.median(steps), dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        out[placement] = {"step_s": float(seconds), "overlap_window": statistics.median(windows),
                          "buckets": len(engine.buckets)}
    dist.destroy_process_group()
    return out

"""A device's own figures in one command: compute per op class and dtype, memory bandwidth,
host-device copies, every compressor's encode + decode throughput on 25 MB and 100 MB buckets, and
the data-parallel engine's own overhead at world size 1 against the plain loop and torch DDP.

    PYTHONPATH=src python3 benchmarks/gpu.py --json benchmarks/results/gpu.json   # on a GPU machine
    python benchmarks/gpu.py --quick --device cpu --json /tmp/gpu.json             # a smoke run anywhere

The overhead runs the DDP loop (zero_grad, forward and loss under autocast, backward,
optimizer.step) on one GPT for each of: the bare model, `paraloom.DataParallel(model)` (hooks and
buckets active: no shortcut for one rank) and `torch.nn.parallel.DistributedDataParallel(model)`,
in interleaved rounds, each round a fresh model from the same seed; the figure is each variant's
median step time and its ratio to the others'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import make_table, write_json
from rich.console import Console

from paraloom.data_parallel import DataParallel
from paraloom.models.gpt import GPT
from paraloom.perfmodel.microbench import DTYPES, codec_rates, compute_rates, copy_rates

GPT_350M = {"seq_len": 1024, "n_layers": 24, "d_model": 1024, "n_heads": 16, "batch": 8}
GPT_QUICK = {"seq_len": 32, "n_layers": 2, "d_model": 64, "n_heads": 4, "batch": 4}
QUICK_SIZES = {"matmul": 128, "conv": (2, 8, 16), "attention": (2, 2, 64, 16), "elements": 2**16}
BUCKETS_MB = (25, 100)


def one_rank_group(device: torch.device, store_dir: str) -> None:
    """A process group of this process alone: NCCL on a GPU, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))


def overhead(device: torch.device, gpt: dict[str, int], *, steps: int, warmup: int, rounds: int,
             dtype: str) -> dict[str, Any]:
    """Median step seconds of the bare model, paraloom's DataParallel and torch DDP at world size 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (gpt["batch"], gpt["seq_len"] + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    wrappers = {"plain": lambda m: m, "paraloom": DataParallel,
                "ddp": lambda m: DDP(m, device_ids=[device.index] if device.type == "cuda" else None)}
    seconds: dict[str, list[float]] = {name: [] for name in wrappers}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for r in range(rounds):
        for name in (list(wrappers) if r % 2 == 0 else list(reversed(wrappers))):
            torch.manual_seed(0)
            model = GPT((gpt["seq_len"],), 256, n_layers=gpt["n_layers"], d_model=gpt["d_model"],
                        n_heads=gpt["n_heads"]).to(device)
            net = wrappers[name](model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times = []
            for i in range(warmup + steps):
                sync()
                began = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "fp32"):
                    loss = F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
                loss.backward()
                optimizer.step()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - began)
            seconds[name].append(statistics.median(times))
            if name == "paraloom":
                net.close()
            del net, model, optimizer
    median = {name: statistics.median(values) for name, values in seconds.items()}
    params = sum(p.numel() for p in GPT((gpt["seq_len"],), 256, n_layers=gpt["n_layers"],
                                        d_model=gpt["d_model"], n_heads=gpt["n_heads"]).parameters())
    return {"gpt": gpt, "parameters": params, "dtype": dtype, "step_seconds": median, "rounds": seconds,
            "paraloom_vs_plain": median["paraloom"] / median["plain"],
            "paraloom_vs_ddp": median["paraloom"] / median["ddp"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    quick = args.quick
    sizes = QUICK_SIZES if quick else None
    buckets = (1,) if quick else BUCKETS_MB
    console = Console(width=120)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "quick": quick}
    dtypes = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    report["compute"] = {d: compute_rates(device, d, sizes=sizes, min_s=0.01 if quick else 0.05)
                         for d in dtypes}
    if device.type == "cuda":
        report["copies"] = copy_rates(device)
    report["codecs"] = {f"{mb}MB": codec_rates(device, int(mb * 2**20), min_s=0.005 if quick else 0.02)
                        for mb in buckets}
    with tempfile.TemporaryDirectory(prefix="paraloom-gpubench-") as tmp:
        one_rank_group(device, tmp)
        try:
            report["overhead"] = overhead(device, GPT_QUICK if quick else GPT_350M, steps=3 if quick else 20,
                                          warmup=1 if quick else 5, rounds=2 if quick else 3, dtype="bf16")
        finally:
            dist.destroy_process_group()
    write_json(args.json, report)

    table = make_table(f"compute on {report['device']} (TFLOP/s; bandwidth TB/s)",
                       ("dtype", "matmul", "conv", "attention", "other", "bandwidth"), left=("dtype",))
    for dtype, row in report["compute"].items():
        table.add_row(dtype, *(f"{row[k] / 1e12:.3g}" for k in ("matmul", "conv", "attention", "other",
                                                                  "bandwidth")))
    console.print(table)
    table = make_table("codecs: encode + decode, GB/s of fp32 gradient", ("compressor", *report["codecs"]),
                       left=("compressor",))
    for name in next(iter(report["codecs"].values())):
        table.add_row(name, *(f"{report['codecs'][b][name] / 1e9:.3g}" for b in report["codecs"]))
    console.print(table)
    o = report["overhead"]
    console.print(f"engine at world size 1, GPT {o['parameters'] / 1e6:.0f}M {o['dtype']}: step "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in o["step_seconds"].items())
                  + f"; paraloom / plain {o['paraloom_vs_plain']:.3f}, "
                    f"paraloom / DDP {o['paraloom_vs_ddp']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A GPU's figures in one command, in the order of their value: the device's profile from
micro-benchmarks (`paraloom calibrate --device`: compute per op class and dtype, memory bandwidth,
host-device copies, every compressor's encode + decode on 25 MB and 100 MB buckets), the
performance model's single-device step time and peak memory against measured training steps
(GPT 125M to 1.3B, bf16 and fp32, with and without recompute; ResNet-50), and the data-parallel
engine's own overhead at world size 1 against the plain loop and torch DDP.

    PYTHONPATH=src python3 benchmarks/gpu.py --json benchmarks/results/gpu.json \
        --profile benchmarks/results/gpu-profile.yaml                        # on a GPU machine
    python benchmarks/gpu.py --quick --device cpu --json /tmp/gpu.json       # a smoke run anywhere

The report is rewritten after each part, so a run cut short keeps what it measured. The
prediction uses the profile this run measured and nothing else: no constant is fitted to the
measured steps (paraloom/bench/single_device.py). The overhead runs the DDP loop (zero_grad,
forward and loss under autocast, backward, optimizer.step) on one GPT for each of: the bare
model, `paraloom.DataParallel(model)` (hooks and buckets active: no shortcut for one rank) and
`torch.nn.parallel.DistributedDataParallel(model)`, in interleaved rounds, each round a fresh model
from the same seed; the figure is each variant's median step time and its ratio to the others'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import make_table, write_json
from rich.console import Console

from paraloom.bench.single_device import GPU_CASES, QUICK_CASES, compare, trace
from paraloom.data_parallel import DataParallel
from paraloom.models.gpt import GPT
from paraloom.perfmodel.measure.device_profile import BUCKETS_MB, device_profile, measure_device
from paraloom.perfmodel.measure.microbench import DTYPES

GPT_350M = {"seq_len": 1024, "n_layers": 24, "d_model": 1024, "n_heads": 16, "batch": 8}
GPT_QUICK = {"seq_len": 32, "n_layers": 2, "d_model": 64, "n_heads": 4, "batch": 4}
TRACED = ("gpt-125m b8 bf16", "gpt-1.3b b4 bf16", "resnet50 b64 bf16")  # --trace: the cases profiled
QUICK_SIZES = {"matmul": 128, "conv": (2, 8, 16), "attention": (2, 2, 64, 16), "elements": 2**16}


def one_rank_group(device: torch.device, store_dir: str) -> None:
    """A process group of this process alone: NCCL on a GPU, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))


def overhead(device: torch.device, gpt: dict[str, int], *, steps: int, warmup: int, rounds: int,
             dtype: str, traces: dict[str, str] | None = None) -> dict[str, Any]:
    """Median step seconds of the bare model, paraloom's DataParallel and torch DDP at world size 1;
    with `traces`, torch.profiler's tables of two more steps of each, after the last round."""
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
            def step(net=net, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "fp32"):
                    loss = F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
                loss.backward()
                optimizer.step()

            times = []
            for i in range(warmup + steps):
                sync()
                began = time.perf_counter()
                step()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - began)
            seconds[name].append(statistics.median(times))
            if traces is not None and r == rounds - 1:
                traces[f"engine: {name}"] = trace(step, device, 2)
            del step
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
    parser.add_argument("--profile", help="also write the measured hardware profile here (YAML)")
    parser.add_argument("--preset", help="the data sheet the profile's efficiencies are fractions of")
    parser.add_argument("--trace", help="also write torch.profiler's tables of a few cases and of the "
                        "engine's variants here (text)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    quick = args.quick
    console = Console(width=120)
    say = lambda text: console.print(f"[dim]{text}[/dim]")  # noqa: E731

    measured = measure_device(device, sizes=QUICK_SIZES if quick else None, min_s=0.005 if quick else 0.05,
                              buckets_mb=(1,) if quick else BUCKETS_MB, progress=say)
    hw, comparison = device_profile(measured, preset=args.preset)
    if args.profile:
        Path(args.profile).write_text(hw.to_yaml())
    report: dict[str, Any] = {**measured, "quick": quick, "profile": hw.to_dict(), "efficiency": comparison}
    write_json(args.json, report)
    print_device(console, report)

    cases = QUICK_CASES if quick else GPU_CASES
    traces: dict[str, str] | None = {} if args.trace else None
    report["prediction"] = compare(cases, hw, device, steps=2 if quick else 10, warmup=1 if quick else 3,
                                   traced=TRACED if traces is not None and not quick else
                                   (cases[0].label,) if traces is not None else (),
                                   progress=lambda label: say(f"predict and measure {label}"))
    for row in report["prediction"]["rows"]:
        if "trace" in row:
            traces[f"case: {row['case']}"] = row.pop("trace")
    write_json(args.json, report)
    print_prediction(console, report["prediction"])

    with tempfile.TemporaryDirectory(prefix="paraloom-gpubench-") as tmp:
        one_rank_group(device, tmp)
        try:
            say("engine overhead at world size 1")
            report["overhead"] = overhead(device, GPT_QUICK if quick else GPT_350M, steps=3 if quick else 20,
                                          warmup=1 if quick else 5, rounds=2 if quick else 3, dtype="bf16",
                                          traces=traces)
        finally:
            dist.destroy_process_group()
    write_json(args.json, report)
    if traces is not None:
        Path(args.trace).write_text("\n\n".join(f"== {name}\n{text}" for name, text in traces.items()))
    o = report["overhead"]
    console.print(f"engine at world size 1, GPT {o['parameters'] / 1e6:.0f}M {o['dtype']}: step "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in o["step_seconds"].items())
                  + f"; paraloom / plain {o['paraloom_vs_plain']:.3f}, "
                    f"paraloom / DDP {o['paraloom_vs_ddp']:.3f}")
    return 0


def print_device(console: Console, report: dict[str, Any]) -> None:
    table = make_table(f"compute on {report['device']} (TFLOP/s; bandwidth TB/s)",
                       ("dtype", "matmul", "conv", "attention", "other", "bandwidth"), left=("dtype",))
    for dtype, row in report["compute"].items():
        table.add_row(dtype, *(f"{row[k] / 1e12:.3g}" for k in ("matmul", "conv", "attention", "other",
                                                                  "bandwidth")))
    console.print(table)
    efficiency = report["efficiency"]
    peaks = efficiency["preset"] or "measured"
    table = make_table(f"efficiency against the {peaks} peaks: assumed / measured",
                       ("dtype", "matmul", "conv", "attention", "other"), left=("dtype",))
    for dtype, classes in efficiency["efficiency"].items():
        table.add_row(dtype, *(("-" if pair["assumed"] is None else f"{pair['assumed']:.2f}")
                               + f" / {pair['measured']:.3f}" for pair in classes.values()))
    console.print(table)
    table = make_table("codecs: encode + decode, GB/s of fp32 gradient", ("compressor", *report["codecs"]),
                       left=("compressor",))
    for name in next(iter(report["codecs"].values())):
        table.add_row(name, *(f"{report['codecs'][b][name] / 1e9:.3g}" for b in report["codecs"]))
    console.print(table)


def print_prediction(console: Console, prediction: dict[str, Any]) -> None:
    table = make_table("one device: predicted against measured", ("case", "predicted ms", "measured ms",
                       "error", "predicted GiB", "measured GiB", "error"), left=("case",))
    for row in prediction["rows"]:
        memory = row["measured_bytes"]
        table.add_row(row["case"], f"{row['predicted_s'] * 1e3:.1f}", f"{row['measured_s'] * 1e3:.1f}",
                      f"{row['time_error']:+.1%}", f"{row['predicted_bytes'] / 2**30:.2f}",
                      "-" if memory is None else f"{memory / 2**30:.2f}",
                      "-" if row["memory_error"] is None else f"{row['memory_error']:+.1%}")
    console.print(table)
    worst = prediction["memory_error_max"]
    console.print(f"step time: median |error| {prediction['time_error_median']:.1%}, max "
                  f"{prediction['time_error_max']:.1%}; peak memory: max |error| "
                  + ("-" if worst is None else f"{worst:.1%}"))


if __name__ == "__main__":
    sys.exit(main())

"""The peers of paraloom's model parallelism, on the same GPT and text: torch.distributed.pipelining
(ScheduleGPipe, Schedule1F1B) and DTensor tensor parallelism (parallelize_module).

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/mp_peer.py \
        --kind pipelining|dtensor [--schedule gpipe|1f1b] [--microbatches M] --json OUT

Each rank trains `--steps` steps of Adam on the same batches paraloom's runs read (the first
`--warmup` are not timed); global rank 0 writes the median step time, the losses and the
parameter bytes of its rank. Run by benchmarks/model_parallel.py; not a paraloom feature.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.data import ShardedBatches, load_text
from paraloom.models.gpt import GPT, Block
from paraloom.pipeline_parallel.partition import balance_by_params


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def permute_qkv_for_columns(block: Block, tp: int) -> None:
    """Reorder the fused qkv rows from (3, heads, dim) to (tp, 3, heads/tp, dim), so that DTensor's
    contiguous column split hands each rank the q, k and v rows of its own heads."""
    attn = block.attn
    h, d = attn.n_heads, attn.head_dim
    with torch.no_grad():
        w = attn.qkv.weight.view(3, tp, h // tp, d, -1).transpose(0, 1).reshape_as(attn.qkv.weight)
        b = attn.qkv.bias.view(3, tp, h // tp, d).transpose(0, 1).reshape_as(attn.qkv.bias)
        attn.qkv.weight.copy_(w)
        attn.qkv.bias.copy_(b)


def build(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT((args.seq_len,), 256, n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads)


def batches(args: argparse.Namespace):
    split = load_text(seq_len=args.seq_len, text_bytes=args.text_bytes)
    order = ShardedBatches(len(split.y_train), args.batch_size, rank=0, world=1, seed=args.seed)
    for epoch in range(10**6):
        for idx, count in order.epoch(epoch):
            if count == args.batch_size:
                yield split.x_train[idx], split.y_train[idx]


def run_pipelining(args: argparse.Namespace, rank: int, world: int) -> tuple[list[float], list[float], int]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    gpt = build(args)
    start, end = balance_by_params(list(gpt), world)[rank]
    module = nn.Sequential(*list(gpt)[start:end])
    mb = args.batch_size // args.microbatches
    example = (torch.zeros(mb, args.seq_len, dtype=torch.long) if rank == 0
               else torch.zeros(mb, args.seq_len, args.d_model))
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=(example,))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = kind(stage, args.microbatches, loss_fn=lm_loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=args.lr)
    times, losses = [], []
    data = batches(args)
    for _ in range(args.steps):
        x, y = next(data)
        began = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=step_losses)
            losses.append(float(torch.stack(step_losses).detach().mean()))
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    return times, losses, sum(p.numel() * p.element_size() for p in module.parameters())


def run_dtensor(args: argparse.Namespace, rank: int, world: int) -> tuple[list[float], list[float], int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    gpt = build(args)
    mesh = init_device_mesh("cpu", (world,))
    for piece in gpt:
        if isinstance(piece, Block):
            permute_qkv_for_columns(piece, world)
            parallelize_module(piece, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                             "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
            piece.attn.n_heads //= world
    optimizer = torch.optim.Adam(gpt.parameters(), lr=args.lr)
    times, losses = [], []
    data = batches(args)
    for _ in range(args.steps):
        x, y = next(data)
        began = time.perf_counter()
        loss = lm_loss(gpt(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
        losses.append(float(loss.detach()))
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in gpt.parameters())
    return times, losses, local


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("pipelining", "dtensor"), required=True)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--text-bytes", type=int, default=1_000_000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        run = run_pipelining if args.kind == "pipelining" else run_dtensor
        times, losses, param_bytes = run(args, rank, world)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"losses": losses, "param_bytes": param_bytes,
                                          "step_s": statistics.median(times[args.warmup:])})
        if rank == 0:  # written before teardown: a peer's crash while exiting cannot lose the figures
            step_s = max(g["step_s"] for g in gathered)  # the step ends when the slowest rank is done
            losses = next((g["losses"] for g in reversed(gathered) if g["losses"]), [])
            Path(args.json).write_text(json.dumps({
                "kind": args.kind, "schedule": args.schedule, "microbatches": args.microbatches,
                "world_size": world, "step_seconds": step_s, "losses": losses,
                "param_bytes_per_rank": [g["param_bytes"] for g in gathered]}, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

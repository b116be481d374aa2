"""Time-to-accuracy benchmark of gradient compressors against torch DDP, in one process group.

Every variant trains the same model (same seed, same initial weights) on the same digits shards
in the same order, with Adam, for `epochs` epochs; variants take turns in one process group.
Per epoch, the training steps alone are timed (barrier before, `finish()` after, the slowest
rank's time kept); test accuracy is evaluated after every epoch, outside the timed span.
Time to accuracy (TTA) is the training time summed up to the end of the first epoch whose test
accuracy reaches `target` (None if none does). Wire bytes per step are the payload bytes this
rank hands to collectives: paraloom's `engine.stats.bytes` over the steps; for torch DDP, 4 bytes
per parameter (fp32 all-reduce) or 2 (the fp16 hook), which is the same quantity. Encode+decode
time per step is measured after training, apart from it: one compress of every bucket-sized
piece of a real gradient plus the decodes a step does (one for an all-reduced payload, one per
rank for an all-gathered one), median of a few repeats, slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

COMPRESSORS = ("fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "randomk", "dgc")
VARIANTS = ("ddp", "ddp_fp16", "wait_free", *COMPRESSORS, "topk_0.001", "dgc_0.001")
# name -> (compressor, options); DGC runs without momentum correction under Adam (trainer.dgc_options)
ENGINE_VARIANTS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "wait_free": (None, {}),
    **{name: (name, {}) for name in COMPRESSORS},
    "dgc": ("dgc", {"momentum": 0.0}),
    "topk_0.001": ("topk", {"density": 0.001}),
    "dgc_0.001": ("dgc", {"momentum": 0.0, "density": 0.001}),
}
CODEC_REPEATS = 3


def _model(hidden: int, depth: int):
    from paraloom.models import MLP

    return MLP((1, 8, 8), 10, hidden=hidden, depth=depth)


def _max(value: float) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def codec_seconds(variant: str, pieces: list, world: int) -> float:
    """Encode+decode seconds of one step's worth of pieces (see the module docstring)."""
    import torch

    from paraloom.compress import make_compressor
    from paraloom.data_parallel.compressed import decode_sum

    if variant == "ddp":
        return 0.0
    if variant == "ddp_fp16":  # what torch's fp16_compress_hook does around its all-reduce
        def once() -> None:
            for piece in pieces:
                piece.to(torch.float16).div_(world).to(torch.float32)
    else:
        name, options = ENGINE_VARIANTS[variant]
        if name is None:
            return 0.0
        compressor = make_compressor(name, **options)

        def once() -> None:
            for key, piece in enumerate(pieces):
                payload, ctx = compressor.compress(piece, key)
                if compressor.summable:
                    compressor.decompress(payload, ctx)
                else:  # the engine's decode of `world` gathered payloads
                    decode_sum(compressor, payload.expand(world, -1), ctx, torch.empty_like(piece))
    once()  # first call: allocations, error-feedback memory
    times = []
    for _ in range(CODEC_REPEATS):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(options: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paraloom.data import ShardedBatches, load_dataset
    from paraloom.data_parallel import DataParallel
    from paraloom.topology import Topology
    from paraloom.train.trainer import batch_loss, evaluate

    if options.get("interface"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", options["interface"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    split = load_dataset("digits")
    batches = ShardedBatches(len(split.y_train), options["batch"], rank=rank, world=world, seed=0)
    hidden, depth, epochs = options["hidden"], options["depth"], options["epochs"]

    groups = Topology.for_world(world).init_groups()

    # the two sides of a step: computation alone, one fp32 all-reduce of all gradients
    torch.manual_seed(0)
    bare = _model(hidden, depth)
    bare_optimizer = torch.optim.Adam(bare.parameters(), lr=options["lr"])
    n_params = sum(p.numel() for p in bare.parameters())
    first = next(iter(batches.epoch(0)))
    x0, y0, count0 = split.x_train[first[0]], split.y_train[first[0]], first[1]

    def local_step() -> None:
        bare_optimizer.zero_grad(set_to_none=False)
        batch_loss(bare, x0, y0, global_count=count0, dp_world_size=world)[0].backward()
        bare_optimizer.step()

    flat = torch.zeros(n_params)

    def probe(fn, n: int = 5) -> float:
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return _max((time.perf_counter() - start) / n)

    compute_s = probe(local_step)
    allreduce_s = probe(lambda: dist.all_reduce(flat))
    # a real gradient, for the codec timings
    bare_optimizer.zero_grad(set_to_none=False)
    batch_loss(bare, x0, y0, global_count=count0, dp_world_size=world)[0].backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in bare.parameters()][::-1])

    results: dict[str, Any] = {}
    for variant in options["variants"]:
        torch.manual_seed(0)
        model = _model(hidden, depth)
        is_ddp = variant.startswith("ddp")
        if is_ddp:
            engine = DDP(model, bucket_cap_mb=options["bucket_mb"])
            if variant == "ddp_fp16":
                engine.register_comm_hook(None, fp16_compress_hook)
        else:
            name, compressor_options = ENGINE_VARIANTS[variant]
            engine = DataParallel(model, bucket_mb=options["bucket_mb"], scheduler="wait_free",
                                  compressor=name, compressor_options=compressor_options)
            engine.stats.take()  # the initial broadcast is not a step's traffic
        optimizer = torch.optim.Adam(model.parameters(), lr=options["lr"])
        train_s, steps, accs, tta = 0.0, 0, [], None
        for epoch in range(epochs):
            dist.barrier()
            start = time.perf_counter()
            for idx, count in batches.epoch(epoch):
                loss = batch_loss(engine, split.x_train[idx], split.y_train[idx], global_count=count,
                                  dp_world_size=world)[0]
                if is_ddp:
                    optimizer.zero_grad(set_to_none=False)
                    loss.backward()
                    optimizer.step()
                else:
                    loss.backward()
                    engine.step(optimizer)
                steps += 1
            if not is_ddp:
                engine.finish()
            train_s += _max(time.perf_counter() - start)
            accs.append(evaluate(model, split, groups))
            if tta is None and accs[-1] >= options["target"]:
                tta = train_s
        if is_ddp:
            wire = (4 if variant == "ddp" else 2) * n_params
            sizes = [n_params]  # DDP's buckets differ, but the casts cost the same per element
        else:
            wire = engine.stats.bytes / steps
            sizes = [bucket.buffer.numel() for bucket in engine.buckets]
            engine.close()
        pieces = list(gradient.split(sizes)) if sum(sizes) == n_params else [gradient]
        codec_s = _max(codec_seconds(variant, pieces, world))
        results[variant] = {"train_s": train_s, "steps": steps, "step_s": train_s / steps,
                            "wire_bytes_per_step": wire, "wire_ratio": 4 * n_params / wire,
                            "accuracy": accs, "final_accuracy": accs[-1], "tta_s": tta,
                            "tta_epoch": next((i + 1 for i, a in enumerate(accs) if a >= options["target"]),
                                              None),
                            "codec_s_per_step": codec_s}
        del engine, model, optimizer
    if rank == 0:
        Path(options["results_path"]).write_text(json.dumps(
            {"world_size": world, "params": n_params, "compute_s": compute_s, "allreduce_s": allreduce_s,
             "variants": results}))
    dist.destroy_process_group()


def run(*, cluster=None, nproc: int = 4, hidden: int = 1024, depth: int = 3, batch: int = 128,
        epochs: int = 10, lr: float = 1e-3, target: float = 0.93, bucket_mb: float = 25.0,
        variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Launch `measure` on `cluster` (one worker per node) or on `nproc` loopback workers."""
    import tempfile

    from paraloom.cluster.launch import BENCH_RESTARTS, torchrun_on_cluster
    from paraloom.launch import elastic_run

    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    with tempfile.TemporaryDirectory(prefix="paraloom-cmpbench-") as tmp:
        options = {"hidden": hidden, "depth": depth, "batch": batch, "epochs": epochs, "lr": lr,
                   "target": target, "bucket_mb": bucket_mb, "variants": list(variants),
                   "results_path": str(Path(tmp) / "r.json"), "interface": None if cluster else "lo"}
        if cluster is not None:
            torchrun_on_cluster(cluster, ["paraloom.compress.bench", "--options", json.dumps(options)],
                                log_dir=Path(tmp), max_restarts=BENCH_RESTARTS)
        else:
            elastic_run(measure, (options,), nproc=nproc)
        out = json.loads(Path(options["results_path"]).read_text())
    out["recipe"] = {k: v for k, v in options.items() if k not in ("results_path", "interface")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paraloom.compress.bench")
    parser.add_argument("--options", required=True)
    measure(json.loads(parser.parse_args(argv).options))
    return 0


if __name__ == "__main__":
    from paraloom.worker import exit_process

    exit_process(main())  # see exit_process: a finished worker must not abort in teardown

"""gloo's own all-reduce against paraloom's ring per dtype and size: why float16 goes around the ring.

Forks N gloo workers on loopback (one thread each) and times, alternated in every round, each
dtype's all-reduce through `dist.all_reduce` (gloo's own sum) and `comm.algorithms.ring` (torch's
vectorized sums). Prints the median milliseconds and the ring's time over gloo's; `--json OUT`
keeps them. Usage: python benchmarks/half_sums.py [--nproc 2 4] [--rounds 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_table, write_json  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMELS = (16_384, 131_072, 1_048_576, 4_194_304)


def _worker(rank: int, world: int, store: str, rounds: int, queue) -> None:
    from paraloom.comm.algorithms import ring
    from paraloom.comm.p2p import Peers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    peers = Peers()
    ways = {"gloo": dist.all_reduce, "ring": lambda t: ring(t, peers)}
    seconds: dict[tuple, list[float]] = {}
    for numel in NUMELS:
        for dtype in DTYPES:
            tensor = torch.randn(numel).to(DTYPES[dtype])
            for reduce in ways.values():  # warm-up: connections, scratch buffers
                reduce(tensor)
            for _ in range(rounds):
                for way, reduce in ways.items():
                    dist.barrier()
                    start = time.perf_counter()
                    reduce(tensor)
                    seconds.setdefault((numel, dtype, way), []).append(time.perf_counter() - start)
    if rank == 0:
        queue.put({key: statistics.median(values) for key, values in seconds.items()})
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, rounds: int) -> list[dict]:
    """Rows of (numel, dtype, gloo ms, ring ms, ring over gloo) on `world` processes."""
    queue = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), rounds, queue),
                           nprocs=world, start_method="fork")
    medians = queue.get()
    return [{"nproc": world, "numel": n, "dtype": d, "gloo_ms": medians[(n, d, "gloo")] * 1e3,
             "ring_ms": medians[(n, d, "ring")] * 1e3,
             "ring_over_gloo": medians[(n, d, "ring")] / medians[(n, d, "gloo")]}
            for n in NUMELS for d in DTYPES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [row for world in args.nproc for row in measure(world, args.rounds)]
    table = make_table("all-reduce on loopback, median ms", ["nproc", "elements", "dtype", "gloo", "ring",
                                                            "ring / gloo"], left=["dtype"])
    for r in rows:
        table.add_row(str(r["nproc"]), f"{r['numel']:,}", r["dtype"], f"{r['gloo_ms']:.2f}",
                      f"{r['ring_ms']:.2f}", f"{r['ring_over_gloo']:.2f}")
    from rich.console import Console

    Console().print(table)
    if args.json:
        write_json(args.json, {"rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()

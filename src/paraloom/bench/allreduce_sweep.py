"""All-reduce algorithms timed in the manner of nccl-tests: time, algbw = S/t, busbw = algbw * 2(n-1)/n."""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from paraloom.config.errors import UserError

_SIZE = re.compile(r"(\d+)\s*(B|KB|MB|GB)", re.IGNORECASE)
_SCALE = {"b": 1, "kb": 2**10, "mb": 2**20, "gb": 2**30}
REFERENCE_BYTES = 16 * 2**20  # summary.busbw_frac_16MB is read at this size


def parse_size(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UserError(f"size {text!r} is not a size; write e.g. 1KB, 4MB or 1GB")
    return int(match.group(1)) * _SCALE[match.group(2).lower()]


def parse_sizes(text: str, factor: int = 4) -> list[int]:
    """'1KB..64MB' -> 1KB, 4KB, ... 64MB (times `factor`); '1MB,16MB' -> exactly those."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        if lo < 4 or hi < lo:
            raise UserError(f"--sizes {text!r} must go from at least 4B up to a larger size")
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
        return sizes
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) < 4:
        raise UserError(f"--sizes {text!r} must list sizes of at least 4B")
    return sorted(set(sizes))


def format_size(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= _SCALE[unit.lower()] and nbytes % _SCALE[unit.lower()] == 0:
            return f"{nbytes // _SCALE[unit.lower()]}{unit}"
    return f"{nbytes}B"


def measure(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank's part: join the group, time every (algorithm, size); returns the rows.

    Each (algorithm, size) is warmed up, then timed `repeats` times between barriers, and the
    slowest rank's time of each repeat counts; the median is reported.
    """
    import torch
    import torch.distributed as dist

    from paraloom.comm.algorithms import all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=options["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        dtype = getattr(torch, options.get("dtype", "float32"))
        for size in options["sizes"]:
            x = torch.zeros(size // dtype.itemsize, dtype=dtype)
            for algorithm in options["algorithms"]:
                cpu: list[float] = []

                def once(x: torch.Tensor = x, algorithm: str = algorithm, cpu: list[float] = cpu) -> float:
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    all_reduce(x, algorithm=algorithm)
                    cpu.append(time.process_time() - cpu_start)  # this process, every thread (gloo's too)
                    return time.perf_counter() - start

                for _ in range(options["warmup"]):
                    once()
                cpu.clear()
                first = torch.tensor([once()], dtype=torch.float64)
                dist.all_reduce(first, op=dist.ReduceOp.MAX)  # every rank picks the same count
                repeats = int(min(options["max_repeats"],
                                  max(options["min_repeats"], options["budget_s"] // first.item())))
                times = torch.tensor([first.item()] + [once() for _ in range(repeats - 1)],
                                     dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a repeat lasts as long as its slowest rank
                cpu_s = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
                dist.all_reduce(cpu_s)  # the mean over ranks of each rank's median
                seconds = statistics.median(times.tolist())
                algbw = size / seconds / 1e6
                rows.append({"algorithm": algorithm, "bytes": size, "repeats": repeats,
                             "seconds": seconds, "seconds_min": min(times.tolist()),
                             "cpu_seconds": cpu_s.item() / world,
                             "algbw_MBps": algbw, "busbw_MBps": algbw * 2 * (world - 1) / world})
                if rank == 0 and options.get("progress"):
                    print(f"  {format_size(size):>6} {algorithm:<17} {seconds * 1e3:9.2f} ms "
                          f"busbw {rows[-1]['busbw_MBps']:8.1f} MB/s", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    return {"world_size": world, "rows": rows}


def summarize(rows: list[dict[str, Any]], link_mbps: float) -> dict[str, Any]:
    """busbw / link throughput at 16 MB (or the nearest size above it) for every algorithm."""
    sizes = sorted({r["bytes"] for r in rows})
    ref = next((s for s in sizes if s >= REFERENCE_BYTES), sizes[-1])
    frac = {r["algorithm"]: r["busbw_MBps"] / link_mbps for r in rows if r["bytes"] == ref}
    return {"link_MBps": link_mbps, "reference_bytes": ref, "busbw_frac_16MB": frac}


def run_collectives(*, sizes: list[int], algorithms: list[str], cluster=None, nproc: int = 4,
                    warmup: int = 1, min_repeats: int = 5, max_repeats: int = 20,
                    budget_s: float = 3.0, timeout_s: float = 600.0,
                    progress: bool = True, dtype: str = "float32") -> dict[str, Any]:
    """Measure one TCP stream over the link, then every algorithm at every size on the workers
    (local ones on loopback, or one per node of an emulated cluster); returns the JSON-ready report."""
    from paraloom.bench.harness import launch
    from paraloom.cluster.torchrun import link_throughput

    largest = max(sizes)
    link_bytes = max(16 << 20, min(256 << 20, 2 * largest)) if cluster else 256 << 20
    link_samples = link_throughput(cluster, link_bytes)
    link_mbps = max(link_samples)  # the link's capacity: a slower sample only saw a busy machine
    options = {"sizes": sizes, "algorithms": algorithms, "warmup": warmup,
               "min_repeats": min_repeats, "max_repeats": max_repeats, "budget_s": budget_s,
               "timeout_s": timeout_s, "progress": progress, "dtype": dtype}
    measured = launch(f"{__name__}:measure", options, cluster=cluster, nproc=nproc)[0]
    where = (f"emulated cluster, {cluster.nodes} nodes x {cluster.spec.rate} links" if cluster
             else f"loopback, {nproc} local workers")
    return {
        "config": {"transport": where, "world_size": measured["world_size"], "sizes": sizes,
                   "algorithms": algorithms, "dtype": dtype, "link_test_bytes": link_bytes,
                   "link_samples_MBps": link_samples,
                   "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()},
        "link_MBps": link_mbps,
        "results": measured["rows"],
        "summary": summarize(measured["rows"], link_mbps),
    }


def report_table(report: dict[str, Any]):
    """A rich table: one row per size, busbw (and time) per algorithm, link throughput on top."""
    from rich.table import Table

    algorithms = report["config"]["algorithms"]
    table = Table(title=f"all-reduce, {report['config']['transport']}, link {report['link_MBps']:.1f} MB/s "
                        "(one TCP stream); per algorithm: median ms, busbw MB/s")
    table.add_column("size", justify="right", no_wrap=True)
    for algorithm in algorithms:
        table.add_column(f"{algorithm}\nms  busbw", justify="right", no_wrap=True)
    by_key = {(r["bytes"], r["algorithm"]): r for r in report["results"]}
    for size in report["config"]["sizes"]:
        cells = []
        for algorithm in algorithms:
            r = by_key.get((size, algorithm))
            cells.append("-" if r is None else f"{r['seconds'] * 1e3:.2f}  {r['busbw_MBps']:.1f}")
        table.add_row(format_size(size), *cells)
    frac = report["summary"]["busbw_frac_16MB"]
    table.caption = (f"busbw / link at {format_size(report['summary']['reference_bytes'])}: "
                     + ", ".join(f"{a} {v:.2f}" for a, v in frac.items()))
    return table

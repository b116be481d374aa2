"""What a blocking collective costs between compute segments on this host, beyond its own time.

    python benchmarks/collective_arrival.py [--quick] [--ranks 2 4] [--segments-ms 1 4 16] [--rounds 5]
                                            [--kinds all_reduce all_gather reduce_scatter] [--kb 0.004 800]
                                            --json OUT

n gloo ranks (one thread each, loopback) run `iterations` rounds of a compute segment (single-thread
256 x 256 matmuls, as many as take `segment` ms on one idle core, counted once before the ranks
start) and, in the "with" pass, a 4-byte all-reduce after each segment: the pattern of a fully
sharded or tensor-parallel step on a CPU host, where gloo's collectives block the computing thread.
Per round, alone and with alternate; the penalty per collective is the median over rounds of
(with - alone) / iterations, minus the same all-reduce's own time with no compute between
(`isolated`). What is left is the ranks arriving apart: a rank whose segment ran longer (a core
shared with another rank or a thread) holds the others at the collective. Summary: per n and
segment, `penalty_ms`, `isolated_ms` and `alone_ms` (a segment as the n ranks run it together).
`--kinds` and `--kb` measure the same for all-gathers and reduce-scatters of real payloads (`by_kind`, by
kind, bytes a rank and n): with - alone is then what such a collective costs a step between segments,
its own time included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERATIONS = 40


def _matmuls_for(segment_ms: float) -> int:
    """Matmuls that take `segment_ms` on one idle core (measured in the parent, before any rank runs)."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(10):
        a @ a
    began = time.perf_counter()
    for _ in range(100):
        a @ a
    return max(1, round(segment_ms / 1e3 / ((time.perf_counter() - began) / 100)))


KINDS = ("all_reduce", "all_gather", "reduce_scatter")
# torch 2.13 renamed the flat collectives (the old names warn); releases before have only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(kind: str, numel: int, n: int):
    """One blocking collective of `kind` on `numel` fp32 elements a rank (the shard's, for a gather
    or a reduce-scatter: the whole is n of them)."""
    shard, whole = torch.zeros(numel), torch.zeros(numel * n)
    if kind == "all_gather":
        return lambda: _all_gather_flat(whole, shard)
    if kind == "reduce_scatter":
        return lambda: _reduce_scatter_flat(shard, whole)
    return lambda: dist.all_reduce(shard)


def _rank(rank: int, n: int, store_path: str, plans: list[tuple[float, int]], rounds: int, queue,
          kind: str = "all_reduce", numel: int = 1) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=rank, world_size=n)
    a, collective = torch.randn(256, 256), _collective(kind, numel, n)
    out = []
    for segment_ms, count in plans:
        seconds: dict[str, list[float]] = {"alone": [], "with": [], "isolated": []}
        for _ in range(rounds):
            for mode in ("alone", "with", "isolated"):
                dist.barrier()
                began = time.perf_counter()
                for _ in range(ITERATIONS):
                    if mode != "isolated":
                        for _ in range(count):
                            a @ a
                    if mode != "alone":
                        collective()
                seconds[mode].append((time.perf_counter() - began) / ITERATIONS)
        dist.barrier()
        alone, both, isolated = (statistics.median(seconds[m]) for m in ("alone", "with", "isolated"))
        out.append({"segment_ms": segment_ms, "alone_ms": alone * 1e3, "isolated_ms": isolated * 1e3,
                    "penalty_ms": (both - alone - isolated) * 1e3,
                    "rounds": {m: [s * 1e3 for s in v] for m, v in seconds.items()}})
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure(n: int, plans: list[tuple[float, int]], rounds: int, kind: str = "all_reduce",
            numel: int = 1) -> list[dict]:
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="paraloom-arrival-") as tmp:
        ranks = [ctx.Process(target=_rank, args=(r, n, str(Path(tmp) / "store"), plans, rounds, queue, kind,
                                                 numel))
                 for r in range(n)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in ranks):
            raise SystemExit(f"a rank of {n} failed (exit codes {[p.exitcode for p in ranks]})")
    return queue.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--segments-ms", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["all_reduce"],
                        help="the collectives measured (default all_reduce; gathers and reduce-scatters as a "
                             "fully sharded step runs them)")
    parser.add_argument("--kb", type=float, nargs="+", default=[0.004],
                        help="payloads, kB of fp32 a rank holds (a shard, for a gather or a reduce-scatter; "
                             "default 0.004: one float)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 ms segments, 1 round: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.segments_ms, args.rounds = [2], [1.0], 1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    plans = [(ms, _matmuls_for(ms)) for ms in args.segments_ms]
    report = {"options": {"ranks": args.ranks, "segments_ms": args.segments_ms, "rounds": args.rounds,
                          "iterations": ITERATIONS, "cores": os.cpu_count(), "kinds": args.kinds,
                          "kb": args.kb}, "results": {}, "by_kind": {}}
    for kind in args.kinds:
        for kb in args.kb:
            numel = max(1, round(kb * 1e3 / 4))
            for n in args.ranks:
                rows = measure(n, plans, args.rounds, kind, numel)
                report["by_kind"].setdefault(kind, {}).setdefault(str(numel * 4), {})[str(n)] = rows
                if kind == "all_reduce" and numel == 1:  # the table the model reads (cost/cpu.py)
                    report["results"][str(n)] = rows
                for row in rows:
                    print(f"{kind} of {numel * 4} B a rank, {n} ranks, {row['segment_ms']:g} ms segments "
                          f"(run together: {row['alone_ms']:.2f} ms): penalty {row['penalty_ms']:.2f} ms a "
                          f"collective, isolated {row['isolated_ms']:.3f} ms")
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

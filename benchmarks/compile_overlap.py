"""torch.compile (inductor) and DataParallel: step time and how much communication still overlaps backward.

    python benchmarks/compile_overlap.py [--quick] --json OUT

2 workers on loopback, an MLP on random data, wait_free with small buckets, the DDP loop
(zero_grad, backward, optimizer.step). Placements: eager, DataParallel(torch.compile(net)) and
torch.compile(DataParallel(net)), each with the inductor backend. Per placement and step the
engine records when each bucket became ready after forward ended (`ready_at`); the overlap
window is the time from the first bucket's readiness (its all-reduce launches then) to the
last's (backward's computation is done), as a share of that last time. Eager backward frees
buckets as it goes; a compiled backward is one autograd node that computes every gradient
before the first accumulation, which the window measures.
"""

from __future__ import annotations

import argparse
import sys

from common import make_table, write_json
from rich.console import Console

from paraloom.bench.harness import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    options = {"width": 1024, "depth": 6, "batch": 64, "bucket_mb": 4.0, "warmup": 5, "steps": 20}
    if args.quick:
        options = {"width": 64, "depth": 3, "batch": 16, "bucket_mb": 0.01, "warmup": 2, "steps": 3}
    results = launch("paraloom.bench.compile_overlap:measure", options, nproc=2,
                     prefix="paraloom-compilebench-")[0]
    eager = results["eager"]["step_s"]
    table = make_table("inductor and DataParallel, 2 workers on loopback",
                       ("placement", "buckets", "step ms", "vs eager", "overlap window"),
                       left=("placement",))
    for placement, row in results.items():
        row["ratio_vs_eager"] = row["step_s"] / eager
        table.add_row(placement, str(row["buckets"]), f"{row['step_s'] * 1e3:.1f}",
                      f"{row['ratio_vs_eager']:.2f}", f"{row['overlap_window']:.2f}")
    Console(width=120).print(table)
    write_json(args.json, {"options": options, "placements": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

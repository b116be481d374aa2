"""Data-parallel step time: paraloom's engine (fifo, wait_free) against torch DDP in the same run.

    python benchmarks/dp_schedulers.py [--quick] --json OUT

Cases: 4 workers on an emulated 1 Gbit/s cluster (needs root), and 2 workers on loopback.
Model: an MLP on digits with 8.5M parameters (hidden 2048, 3 hidden layers), global batch 64,
SGD with momentum, 25 MB buckets for everyone; DDP both as is and with gradient_as_bucket_view.
Still to come with the rest of the engine: priority, one_step_delay and local_sgd rows and the
balanced-bandwidth case.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from paraloom.cluster import EmulatedCluster, list_clusters, parse_emulate
from paraloom.data_parallel.bench import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    size = {"hidden": 256, "depth": 2, "steps": 3, "warmup": 1, "rounds": 1} if args.quick else {}
    cases = {}
    name = next(f"dp{i}" for i in range(100) if f"dp{i}" not in list_clusters())
    emulate = "2x1gbit" if args.quick else "4x1gbit"
    with EmulatedCluster(parse_emulate(emulate, name=name)) as cluster:
        cases[f"emulated_{emulate}"] = run(cluster=cluster, **size)
    cases["loopback_2"] = run(nproc=2, **size)
    report = {
        "cases": cases,
        "summary": {
            "ratio_waitfree_vs_ddp": cases[f"emulated_{emulate}"]["ratio_vs_ddp"]["wait_free"],
            "ratio_waitfree_vs_ddp_loopback": cases["loopback_2"]["ratio_vs_ddp"]["wait_free"],
        },
    }
    table = Table(title="median step time, slowest rank (ms); ratio to DDP")
    for column in ("case", "compute", "all-reduce", "bound", "ddp", "ddp_view", "fifo", "wait_free"):
        table.add_column(column, justify="right")
    for case, out in cases.items():
        s, r = out["seconds"], out["ratio_vs_ddp"]
        table.add_row(case, f"{s['compute'] * 1e3:.0f}", f"{s['allreduce'] * 1e3:.0f}",
                      f"{out['bound'] * 1e3:.0f}",
                      *[f"{s[v] * 1e3:.0f} ({r[v]:.2f})" for v in ("ddp", "ddp_view", "fifo", "wait_free")])
    Console(width=140).print(table)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

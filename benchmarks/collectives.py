"""All-reduce algorithms against gloo's own on an emulated cluster (nccl-tests definitions).

    python benchmarks/collectives.py [--quick] [--emulate 4x1gbit | --loopback] --json OUT

Needs root for the emulated cluster; --loopback runs 4 local workers instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from paraloom.cluster import EmulatedCluster, list_clusters, parse_emulate
from paraloom.comm.algorithms import ALL_REDUCE_NAMES
from paraloom.comm.bench import parse_sizes, report_table, run_collectives


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 nodes, small sizes: a smoke run")
    parser.add_argument("--emulate", default=None, help="NODESxRATE (default 4x1gbit; 2x1gbit quick)")
    parser.add_argument("--loopback", action="store_true", help="local workers, no cluster")
    parser.add_argument("--json", required=True, help="output file")
    args = parser.parse_args(argv)
    sizes = parse_sizes("4KB..64KB" if args.quick else "1KB..64MB")
    kwargs = {"sizes": sizes, "algorithms": list(ALL_REDUCE_NAMES),
              "min_repeats": 3 if args.quick else 5, "max_repeats": 3 if args.quick else 20,
              "budget_s": 0.5 if args.quick else 3.0}
    if args.loopback:
        report = run_collectives(nproc=2 if args.quick else 4, **kwargs)
    else:
        name = next(f"bc{i}" for i in range(100) if f"bc{i}" not in list_clusters())
        spec = parse_emulate(args.emulate or ("2x1gbit" if args.quick else "4x1gbit"), name=name)
        with EmulatedCluster(spec) as cluster:
            report = run_collectives(cluster=cluster, **kwargs)
    Console(width=140).print(report_table(report))
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""All-reduce algorithms against gloo's own on an emulated cluster (nccl-tests definitions).

    python benchmarks/collectives.py [--quick] [--emulate 4x1gbit | --loopback] --json OUT

Needs root for the emulated cluster; --loopback runs 4 local workers instead.
"""

from __future__ import annotations

import argparse
import sys

from clusters import free_name
from common import write_json
from rich.console import Console

from paraloom.bench.allreduce_sweep import parse_sizes, report_table, run_collectives
from paraloom.cluster import EmulatedCluster, parse_emulate
from paraloom.config.choices import ALL_REDUCE_ALGORITHMS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 nodes, small sizes: a smoke run")
    parser.add_argument("--emulate", default=None, help="NODESxRATE (default 4x1gbit; 2x1gbit quick)")
    parser.add_argument("--loopback", action="store_true", help="local workers, no cluster")
    parser.add_argument("--json", required=True, help="output file")
    args = parser.parse_args(argv)
    sizes = parse_sizes("4KB..64KB" if args.quick else "1KB..64MB")
    kwargs = {"sizes": sizes, "algorithms": list(ALL_REDUCE_ALGORITHMS),
              "min_repeats": 3 if args.quick else 5, "max_repeats": 3 if args.quick else 20,
              "budget_s": 0.5 if args.quick else 3.0}
    if args.loopback:
        report = run_collectives(nproc=2 if args.quick else 4, **kwargs)
    else:
        spec = parse_emulate(args.emulate or ("2x1gbit" if args.quick else "4x1gbit"), name=free_name("bc"))
        with EmulatedCluster(spec) as cluster:
            report = run_collectives(cluster=cluster, **kwargs)
    Console(width=140).print(report_table(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

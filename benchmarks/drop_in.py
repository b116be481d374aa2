"""The DDP drop-in against torch's DDP on a minGPT-shaped transformer, eager and compiled, same run.

    python benchmarks/drop_in.py [--quick] [--repeats 5] [--no-emulate] --json OUT

Model: minGPT's "gpt-mini" shape (6 layers, width 192, 6 heads, torch's MultiheadAttention; 2.7M
parameters in 77 tensors), a character vocabulary (65) and sequences of 128, batch 8 per worker,
AdamW, clipping at norm 1: the loop of pytorch/examples' minGPT-ddp trainer. 2 workers, on loopback
and on an emulated 2 x 1 Gbit/s cluster (needs root: network namespaces). Cases: eager without
dropout (the two must train identical losses), eager with dropout 0.1, eager with a tied output
layer, and dropout 0.1 under `torch.compile` with both wrap orders (`torch.compile(DDP(model))`
and `DDP(torch.compile(model))`, inductor). DDP and `paraloom.DataParallel` take turns in one
process group, block by block (paraloom.bench.drop_in); a case's ratio is the median over rounds
of drop-in step / DDP step.

Summary (`summary` in the JSON, the worse of the two clusters): `eager_vs_ddp`,
`eager_dropout_vs_ddp`, `eager_tied_vs_ddp`, `compiled_vs_ddp` (the worse wrap order), and each
wrap order apart.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from clusters import emulated
from common import make_table, write_json
from rich.console import Console

from paraloom.bench.harness import launch

MODEL = {"vocab": 65, "seq": 128, "layers": 6, "width": 192, "heads": 6}
CASES = {
    "eager": {"placement": "eager", "dropout": 0.0, "tied": False},
    "eager_dropout": {"placement": "eager", "dropout": 0.1, "tied": False},
    "eager_tied": {"placement": "eager", "dropout": 0.1, "tied": True},
    "compiled_outside": {"placement": "compiled_outside", "dropout": 0.1, "tied": False},
    "compiled_inside": {"placement": "compiled_inside", "dropout": 0.1, "tied": False},
}


def summarize(clusters: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each figure the worse (higher) over the clusters measured."""
    def worst(case: str) -> float:
        return max(cases[case]["ratio"] for cases in clusters.values())

    return {"eager_vs_ddp": worst("eager"), "eager_dropout_vs_ddp": worst("eager_dropout"),
            "eager_tied_vs_ddp": worst("eager_tied"),
            "compiled_outside_vs_ddp": worst("compiled_outside"),
            "compiled_inside_vs_ddp": worst("compiled_inside"),
            "compiled_vs_ddp": max(worst("compiled_outside"), worst("compiled_inside"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, eager cases only: a smoke run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per case (default 5)")
    parser.add_argument("--no-emulate", action="store_true", help="loopback only")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    options = {"model": MODEL, "batch": 8, "steps": 5, "warmup": 3, "repeats": args.repeats,
               "bucket_mb": 25.0, "cases": CASES}
    if args.quick:
        options.update(model={**MODEL, "seq": 16, "layers": 2, "width": 32, "heads": 2}, steps=2, warmup=1,
                       repeats=min(args.repeats, 2),
                       cases={k: v for k, v in CASES.items() if v["placement"] == "eager"})
    report: dict[str, Any] = {"options": options, "clusters": {}}
    console = Console(width=120)
    clusters = {"loopback_2": None}
    if not args.no_emulate and not args.quick and os.geteuid() == 0:
        clusters["emulated_2x1gbit"] = 2
    for name, nodes in clusters.items():
        if nodes is None:
            result = launch("paraloom.bench.drop_in:measure", options, nproc=2, prefix="paraloom-dropin-")[0]
        else:
            with emulated(nodes, 1e9, "dropin") as cluster:
                result = launch("paraloom.bench.drop_in:measure", options, cluster=cluster,
                                prefix="paraloom-dropin-")[0]
        report["clusters"][name] = result
        table = make_table(f"drop-in vs DDP, {name}", ("case", "DDP ms", "drop-in ms", "drop-in / DDP",
                                                        "per round"), left=("case",))
        for case, row in result.items():
            table.add_row(case, f"{row['ddp_step_s'] * 1e3:.1f}", f"{row['drop_in_step_s'] * 1e3:.1f}",
                          f"{row['ratio']:.3f}", " ".join(f"{r:.3f}" for r in row["ratio_per_round"]))
        console.print(table)
        write_json(args.json, report)
    if not args.quick:
        report["summary"] = summarize(report["clusters"])
        console.print_json(data=report["summary"])
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fully sharded data parallelism (parallel.shard) against torch's fully_shard and DDP, same run.

    python benchmarks/sharding.py [--quick] [--repeats 5] [--no-emulate] [--speed-only] [--explain] --json OUT

Memory: 4 workers on loopback train the zoo's GPT at width 1024, 8 layers (101M parameters), AdamW;
per rank, the bytes of parameters, gradients and optimizer state held after a step, for DDP, a
bare `fully_shard` loop and paraloom at `gradients` and `full`, and the most parameter bytes
gathered at once during a step. Speed: 4 workers, the GPT at width 256, 4 layers, batch 8 x 64
tokens per worker, on loopback and on an emulated 4 x 1 Gbit/s cluster (needs root): DDP, bare
`fully_shard` and paraloom `full` take turns (paraloom.bench.sharding); a ratio is the median over
rounds of paraloom's step over the peer's.

Summary (`summary` in the JSON): `mem_ratio_full_vs_ddp`, `mem_ratio_gradients_vs_ddp` and
`mem_ratio_vs_fully_shard` (the most bytes of parameters, gradients, optimizer state and their
gather and reduction buffers alive at once during a step, by torch's memory tracker),
`mem_ratio_full_at_rest_vs_ddp` (after a step),
`step_ratio_vs_fully_shard_loopback`, `step_ratio_vs_fully_shard_1gbit`, `step_ratio_vs_ddp_loopback`,
`step_ratio_vs_ddp_1gbit`; the performance model's figures (`model_median_abs_err`,
`model_max_abs_err`, `n_model_configs`) are null until the model prices fully sharded plans.
`--explain` adds the bare loop clipping as paraloom does and paraloom without explicit prefetch
(paraloom.bench.sharding), to tell where a difference between paraloom and the bare loop comes
from; `--speed-only` skips the memory part.
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

BIG = {"vocab": 256, "seq": 64, "layers": 8, "width": 1024, "heads": 16}
SMALL = {"vocab": 256, "seq": 64, "layers": 4, "width": 256, "heads": 4}
TINY = {"vocab": 256, "seq": 16, "layers": 2, "width": 32, "heads": 2}


def summarize(held: dict[str, Any], speed: dict[str, Any]) -> dict[str, Any]:
    def peak(name: str) -> float:  # the most state alive at once during a step, buffers included
        return held[name]["peak_state"]

    ddp = held["ddp"]["total"]
    out: dict[str, Any] = {
        "mem_ratio_full_vs_ddp": peak("paraloom_full") / peak("ddp"),
        "mem_ratio_full_at_rest_vs_ddp": held["paraloom_full"]["total"] / ddp,
        "mem_ratio_gradients_vs_ddp": peak("paraloom_gradients") / peak("ddp"),
        "mem_ratio_vs_fully_shard": peak("paraloom_full") / peak("fully_shard"),
        # parallel.shard_prefetch=0: torch's implicit prefetch only, as the bare loop
        "mem_ratio_no_prefetch_vs_fully_shard": peak("paraloom_full_no_prefetch") / peak("fully_shard"),
    }
    for name, cluster in (("loopback", "loopback_4"), ("1gbit", "emulated_4x1gbit")):
        if cluster in speed:
            out[f"step_ratio_vs_fully_shard_{name}"] = speed[cluster]["ratio_vs_fully_shard"]
            out[f"step_ratio_vs_ddp_{name}"] = speed[cluster]["ratio_vs_ddp"]
    out.update(model_median_abs_err=None, model_max_abs_err=None, n_model_configs=0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, loopback, 2 rounds: a smoke run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-emulate", action="store_true", help="loopback only")
    parser.add_argument("--speed-only", action="store_true", help="skip the memory part")
    parser.add_argument("--explain", action="store_true",
                        help="add the bare loop clipping as paraloom does, and paraloom without prefetch")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    held_options = {"model": TINY if args.quick else BIG, "batch": 2, "levels": ["gradients", "full"]}
    speed_options = {"model": TINY if args.quick else SMALL, "batch": 8, "level": "full", "warmup": 2,
                     "steps": 2 if args.quick else 3,
                     "repeats": min(args.repeats, 2) if args.quick else args.repeats,
                     "explain": ["fully_shard_local_clip", "paraloom_no_prefetch"] if args.explain else []}
    report: dict[str, Any] = {"options": {"held": held_options, "speed": speed_options}, "speed": {}}
    console = Console(width=120)

    if args.speed_only:
        held = {}
    else:
        held = launch("paraloom.bench.sharding:held", held_options, nproc=4, prefix="paraloom-sharding-")[0]
    report["held"] = held
    table = make_table("bytes per rank (MB), dp4", ("variant", "params", "grads", "optimizer", "at rest",
                                                    "peak state", "peak / DDP's"), left=("variant",))
    for name, row in held.items():
        table.add_row(name, *(f"{row[k] / 2**20:.1f}" for k in ("params", "grads", "optimizer", "total",
                                                                  "peak_state")),
                      f"{row['peak_state'] / held['ddp']['peak_state']:.3f}")
    console.print(table)
    write_json(args.json, report)

    clusters: dict[str, int | None] = {"loopback_4": None}
    if not args.no_emulate and not args.quick and os.geteuid() == 0:
        clusters["emulated_4x1gbit"] = 4
    for name, nodes in clusters.items():
        if nodes is None:
            result = launch("paraloom.bench.sharding:speed", speed_options, nproc=4,
                            prefix="paraloom-sharding-")[0]
        else:
            with emulated(nodes, 1e9, "shard") as cluster:
                result = launch("paraloom.bench.sharding:speed", speed_options, cluster=cluster,
                                prefix="paraloom-sharding-")[0]
        report["speed"][name] = result
        shown = ("ddp", "fully_shard", "paraloom", *speed_options["explain"])
        table = make_table(f"step ms, dp4, {name}", (*shown, "paraloom / fully_shard", "per round"))
        table.add_row(*(f"{result[f'{v}_step_s'] * 1e3:.1f}" for v in shown),
                      f"{result['ratio_vs_fully_shard']:.3f}",
                      " ".join(f"{r:.3f}" for r in result["ratio_per_round"]))
        console.print(table)
        write_json(args.json, report)
    if not held:
        write_json(args.json, report)
        return 0
    report["summary"] = summarize(held, report["speed"])
    console.print_json(data=report["summary"])
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

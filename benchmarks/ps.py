"""Parameter server on an emulated 1 Gbit/s cluster: BSP, SSP, ASP and ring all-reduce under stragglers.

    python benchmarks/ps.py [--quick] --json OUT        (needs root: network namespaces)

Every run is `paraloom train --emulate NODESx1gbit` (one process per node, so every byte between
workers and servers crosses a shaped link) on digits, 4 workers, with the parameters of each
epoch's end evaluated after training (time to accuracy = training seconds until the first epoch
at or above TARGET).
  (a) transient straggler, `--inject slow:rank=random,factor=2.0`: BSP, SSP s=1, SSP s=3, ASP
      (one server on its own node) and synchronous ring all-reduce (paraloom's engine);
  (b) persistent straggler, `--inject slow:rank=1,factor=2.0`: the same five;
  (c) no straggler, BSP with k=1 against k=4 servers (a larger model: communication-bound).
The straggler runs train the CNN with 64 channels (~300k parameters, batch 256): enough
computation per step for a straggler's delay to matter next to the communication.
Throughput is the summary's `samples_per_second`: every worker's samples while all of them
were training (last start to first finish), so ASP is not credited with its fast workers'
early finish.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
from rich.console import Console

TARGET = 0.93
STRAGGLER = ["--set", "model.channels=64", "--set", "data.batch_size=256", "--set", "optim.epochs=16"]
STRAGGLER_SERVERS = 1
COMM_BOUND = [
    "--set",
    "model.name=mlp",
    "--set",
    "model.hidden=1024",
    "--set",
    "model.depth=3",
    "--set",
    "data.batch_size=64",
    "--set",
    "optim.epochs=2",
]
VARIANTS = {
    "bsp": ["--set", "ps.consistency=bsp"],
    "ssp1": ["--set", "ps.consistency=ssp", "--set", "ps.staleness=1"],
    "ssp3": ["--set", "ps.consistency=ssp", "--set", "ps.staleness=3"],
    "asp": ["--set", "ps.consistency=asp"],
}
STRAGGLERS = {"transient": "slow:rank=random,factor=2.0", "persistent": "slow:rank=1,factor=2.0"}


def train(args: list[str], out: Path, name: str) -> dict[str, Any]:
    """One `paraloom train` run, every epoch's end evaluated; the figures this benchmark reports."""
    summary = common.train(out, name, args, sets=["run.eval_every_epoch=true"], save_model=True)
    reached = [seconds for seconds, accuracy in summary["epoch_accuracy"] if accuracy >= TARGET]
    return {
        "samples_per_s": summary["samples_per_second"],
        "train_seconds": summary["train_seconds"],
        "accuracy": summary["test_accuracy"],
        "tta_s": reached[0] if reached else None,
        "epoch_accuracy": summary["epoch_accuracy"],
        "wait_seconds_per_worker": summary.get("wait_seconds_per_worker"),
        "cpu_seconds_per_worker": summary.get("cpu_seconds_per_worker"),
        "server_cpu_seconds": [s["cpu_seconds"] for s in summary.get("servers_stats", [])],
        "staleness": [s["staleness"] for s in summary.get("servers_stats", [])],
    }


def ps_args(servers: int, variant: str) -> list[str]:
    return [
        "--emulate",
        f"{4 + servers}x1gbit",
        "--set",
        "parallel.mode=ps",
        "--set",
        f"ps.servers={servers}",
        *VARIANTS[variant],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one epoch, fewer variants: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    straggler_model = [*STRAGGLER, "--set", "optim.epochs=4"] if args.quick else STRAGGLER
    comm_model = [*COMM_BOUND, "--set", "optim.max_steps=10"] if args.quick else COMM_BOUND
    variants = ["bsp", "asp"] if args.quick else list(VARIANTS)
    console = Console(width=140)
    report: dict[str, Any] = {"target": TARGET, "stragglers": {}, "servers": {}}
    with tempfile.TemporaryDirectory(prefix="paraloom-psbench-") as tmp:
        out = Path(tmp)
        for kind, fault in STRAGGLERS.items():
            rows = {}
            for variant in variants:
                rows[variant] = train(
                    [*ps_args(STRAGGLER_SERVERS, variant), *straggler_model, "--inject", fault], out,
                    f"{kind}-{variant}"
                )
            rows["allreduce"] = train(
                ["--emulate", "4x1gbit", "--set", "comm.algorithm=ring", *straggler_model, "--inject", fault],
                out,
                f"{kind}-allreduce",
            )
            report["stragglers"][kind] = rows
            title = f"{kind} straggler ({fault}), 4 workers, {STRAGGLER_SERVERS} server, 1 Gbit/s"
            table = common.make_table(title, ("variant", "samples/s", "vs bsp", "time to acc s", "final acc"))
            for variant, row in rows.items():
                table.add_row(
                    variant,
                    f"{row['samples_per_s']:.0f}",
                    f"{row['samples_per_s'] / rows['bsp']['samples_per_s']:.2f}",
                    "-" if row["tta_s"] is None else f"{row['tta_s']:.1f}",
                    f"{row['accuracy']:.3f}",
                )
            console.print(table)
        for servers in (1, 4):
            report["servers"][f"k{servers}"] = train(
                [*ps_args(servers, "bsp"), *comm_model], out, f"k{servers}"
            )
    report["summary"] = summarize(report)
    console.print_json(data=report["summary"])
    common.write_json(args.json, report)
    return 0


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the runs' rows (throughput ratios, times to accuracy)."""
    transient, persistent = report["stragglers"]["transient"], report["stragglers"]["persistent"]
    return {
        "ssp3_vs_bsp_throughput": (
            transient["ssp3"]["samples_per_s"] / transient["bsp"]["samples_per_s"]
            if "ssp3" in transient
            else None
        ),
        "ssp3_tta_s": transient.get("ssp3", {}).get("tta_s"),
        "bsp_tta_s": transient["bsp"]["tta_s"],
        "asp_vs_bsp_throughput": persistent["asp"]["samples_per_s"] / persistent["bsp"]["samples_per_s"],
        "k4_vs_k1_throughput": report["servers"]["k4"]["samples_per_s"]
        / report["servers"]["k1"]["samples_per_s"],
        "allreduce_vs_bsp_throughput_transient": transient["allreduce"]["samples_per_s"]
        / transient["bsp"]["samples_per_s"],
    }


if __name__ == "__main__":
    sys.exit(main())

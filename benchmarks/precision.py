"""Mixed precision: test accuracy and wall time of fp32, bf16 and fp16 on digits, over seeds.

    python benchmarks/precision.py [--quick] --json OUT

Every run is `paraloom train --nproc 2` of the reference CNN on digits (the default job) with
`run.precision=P` and `run.seed=S` (initialization and data order). The issue judges bf16's mean
test accuracy over SEEDS against fp32's (within 0.5 pt); fp16 is reported beside them with the
loss scale every rank ended at and the steps its scaler skipped. The test set holds 360 digits,
so one point is under 4 of them. CPU autocast runs bf16 and fp16 matmuls and convolutions in
software on a CPU without bf16/fp16 units: their wall time says nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import make_table, train, write_json
from rich.console import Console

PRECISIONS = ("fp32", "bf16", "fp16")
SEEDS = (0, 1, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, a few steps: a smoke run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    seeds = SEEDS[:1] if args.quick else SEEDS
    extra = ["--set", "optim.max_steps=4", "--set", "model.name=mlp"] if args.quick else []
    report: dict[str, Any] = {"runs": {}, "seeds": list(seeds)}
    with tempfile.TemporaryDirectory(prefix="paraloom-precisionbench-") as tmp:
        for precision in PRECISIONS:
            runs = {}
            for seed in seeds:
                summary = train(Path(tmp), f"{precision}-{seed}",
                                ["--nproc", "2", "--set", f"run.precision={precision}",
                                 "--set", f"run.seed={seed}", *extra])
                runs[str(seed)] = {"test_accuracy": summary["test_accuracy"],
                                   "wall_seconds": summary["wall_seconds"],
                                   "skipped_steps": summary["skipped_steps"],
                                   "loss_scale_per_rank": summary.get("loss_scale_per_rank")}
            accuracies = [r["test_accuracy"] for r in runs.values()]
            report["runs"][precision] = {"per_seed": runs, "mean_accuracy": statistics.fmean(accuracies),
                                         "mean_wall_seconds": statistics.fmean(
                                             r["wall_seconds"] for r in runs.values())}
            write_json(args.json, report)
    fp32 = report["runs"]["fp32"]["mean_accuracy"]
    report["bf16_gap_pt"] = 100 * (fp32 - report["runs"]["bf16"]["mean_accuracy"])
    report["fp16_gap_pt"] = 100 * (fp32 - report["runs"]["fp16"]["mean_accuracy"])
    write_json(args.json, report)
    table = make_table("digits CNN, 2 workers: test accuracy by precision",
                       ["precision", *[f"seed {s}" for s in seeds], "mean", "gap vs fp32 (pt)", "wall s"],
                       left=["precision"])
    for precision, row in report["runs"].items():
        per_seed = [f"{row['per_seed'][str(s)]['test_accuracy']:.4f}" for s in seeds]
        gap = 100 * (fp32 - row["mean_accuracy"])
        table.add_row(precision, *per_seed, f"{row['mean_accuracy']:.4f}", f"{gap:+.2f}",
                      f"{row['mean_wall_seconds']:.1f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sparse training: accuracy, wire bytes and step time against sparsity (0, 50, 80, 90, 95%).

    python benchmarks/sparsity.py [--quick] [--loopback] --json OUT      (emulated runs need root)

Every run is `paraloom train` with `sparse.sparsity=S`:
  (a) accuracy: the digits MLP (2 x 512) on 2 workers over loopback, gradual pruning (cubic,
      every 10 steps, reaching S at 40% of the run), Adam, 40 epochs; and the byte-level GPT
      (4 x 128) on 2 workers for a short run (next-byte accuracy). The test set holds 360
      digits, so one point is under 4 of them: dense and 90%, the figures the issue judges, are
      the mean over SEEDS seeds (run.seed: initialization and data order), each seed reported;
  (b) wire and time: 4 workers on an emulated 1 Gbit/s cluster (`--loopback`: on loopback), a
      communication-bound MLP (3 x 1024), one-shot pruning at step 0, steady-state figures from
      the last logged interval of metrics.jsonl (bytes per step and per rank; samples per second).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import make_table, train, write_json
from rich.console import Console

SPARSITIES = (0.0, 0.5, 0.8, 0.9, 0.95)
ACCURACY = ["--set", "model.name=mlp", "--set", "model.hidden=512", "--set", "data.batch_size=64",
            "--set", "optim.epochs=40", "--set", "sparse.every=10"]
GPT = ["--set", "model.name=gpt", "--set", "data.name=text", "--set", "data.seq_len=64",
       "--set", "data.batch_size=32", "--set", "optim.max_steps=200", "--set", "sparse.every=10",
       "--set", "sparse.end_step=100"]
SEEDS = (0, 1, 2)  # accuracy at 0% and 90% (the judged figures) is averaged over these
WIRE_BATCH = 64
WIRE = ["--set", "model.name=mlp", "--set", "model.hidden=1024", "--set", "model.depth=3",
        "--set", f"data.batch_size={WIRE_BATCH}", "--set", "optim.max_steps=60",
        "--set", "sparse.schedule=oneshot", "--set", "run.log_every=20"]


def sparse_args(sparsity: float) -> list[str]:
    return ["--set", f"sparse.sparsity={sparsity}"]


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures at 90% sparsity against dense."""
    acc, wire = report["accuracy"], report["wire"]
    return {
        "acc_drop_pt_90": 100 * (acc["0.0"]["accuracy"] - acc["0.9"]["accuracy"]),
        "wire_ratio_90": wire["0.9"]["bytes_per_step"] / wire["0.0"]["bytes_per_step"],
        "step_ratio_90": wire["0.9"]["step_seconds"] / wire["0.0"]["step_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0 and 90% only, short runs: a smoke run")
    parser.add_argument("--loopback", action="store_true", help="part (b) on loopback (no root needed)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    sparsities = (0.0, 0.9) if args.quick else SPARSITIES
    accuracy_args = [*ACCURACY, "--set", "optim.epochs=1"] if args.quick else ACCURACY
    wire_args = [*WIRE, "--set", "optim.max_steps=10", "--set", "run.log_every=5"] if args.quick else WIRE
    cluster = ["--nproc", "4"] if args.loopback else ["--emulate", "4x1gbit"]
    report: dict[str, Any] = {"accuracy": {}, "gpt": {}, "wire": {}, "cluster": " ".join(cluster)}
    with tempfile.TemporaryDirectory(prefix="paraloom-sparsebench-") as tmp:
        out = Path(tmp)
        for s in sparsities:
            seeds = SEEDS if s in (0.0, 0.9) and not args.quick else SEEDS[:1]
            runs = [train(out, f"acc{s}-{seed}", ["--nproc", "2", *accuracy_args, *sparse_args(s),
                                                  "--set", f"run.seed={seed}"]) for seed in seeds]
            accuracies = [run["test_accuracy"] for run in runs]
            report["accuracy"][str(s)] = {"accuracy": sum(accuracies) / len(accuracies),
                                          "per_seed": dict(zip(map(str, seeds), accuracies, strict=True)),
                                          "sparsity": runs[0].get("sparse", {}).get("sparsity", 0.0)}
            if not args.quick and s in (0.0, 0.9):
                summary = train(out, f"gpt{s}", ["--nproc", "2", *GPT, *sparse_args(s)])
                report["gpt"][str(s)] = {"next_byte_accuracy": summary["test_accuracy"],
                                         "final_loss": summary["final_loss"]}
            summary, metrics = train(out, f"wire{s}", [*cluster, *wire_args, *sparse_args(s)],
                                     with_metrics=True)
            last = metrics[-1]
            report["wire"][str(s)] = {  # the last interval: pruned from step 0 on, warm
                "bytes_per_step": last["comm_bytes"], "step_seconds": WIRE_BATCH / last["samples_per_s"],
                "density_sent": summary.get("sparse", {}).get("gradient_density_sent", 1.0)}
    report["summary"] = summarize(report)
    table = make_table(f"sparsity: digits MLP accuracy (2 workers) and wire/time ({report['cluster']})",
                       ("sparsity", "accuracy", "bytes/step", "vs dense", "step ms", "vs dense"))
    dense = report["wire"]["0.0"]
    for s in sparsities:
        w = report["wire"][str(s)]
        table.add_row(f"{s:.0%}", f"{report['accuracy'][str(s)]['accuracy']:.4f}",
                      f"{w['bytes_per_step']:,.0f}", f"{w['bytes_per_step'] / dense['bytes_per_step']:.3f}",
                      f"{w['step_seconds'] * 1e3:.1f}", f"{w['step_seconds'] / dense['step_seconds']:.2f}")
    Console(width=140).print(table)
    Console().print_json(data=report["summary"])
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

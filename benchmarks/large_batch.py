"""Large batch: 8x the default batch with LAMB (and LARS), warm-up and the scaling rule, against the default.

    python benchmarks/large_batch.py [--quick] [--no-lars] [--text-bytes N] [--sweep] --json OUT

Every run is `paraloom train` on 2 data-parallel workers over loopback: the byte-level GPT
(FULL: 2 blocks x 64) on the standard-library text corpus (500 kB of training bytes, windows of
32 bytes), 6 epochs, cosine decay after a linear warm-up over the first WARMUP_EPOCHS of the
samples (the same share of every run), AdamW-style weight decay 0.01, seed 0. Arms:
  default   batch 64, AdamW at its tuned rate
  lamb-8x   batch 512, LAMB, optim.scale_lr (rate x 512 / 64 from the base rate it was tuned at)
  lars-8x   batch 512, LARS likewise (momentum 0.9, eta 1e-3); `--no-lars` leaves it out
  adamw-8x  batch 512, AdamW at the default's tuned rate scaled by the rule (8x), same warm-up
Same epochs means 8x fewer optimizer steps at 8x the batch. The judged figure is each run's
validation loss (mean nats per byte of held-out files) over the default's: LAMB is within 2%
when the ratio is at most 1.02. The unigram loss (byte frequencies alone) is reported as the bar
a model must get well under to have learned anything.

Rates (LR, in units of a batch of 64: the 8x arms run at 8x) were chosen by `--sweep`, which
runs every arm at every rate of its grid (SWEEP: 3 rates spaced by 2 for every arm; `--rates`
extends a grid whose best lay on its edge) and records every result; seed 0 only. The record is
benchmarks/results/large_batch_sweep.json.

The default size takes ~7 min on 2 cores and gives the 8x arms 186 steps; `--text-bytes 1500000
--no-lars` (~16 min) gives them 552, at the same rates. BENCHMARKS.md has both tables.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import make_table, train, write_json
from rich.console import Console

from paraloom.data.text import load_text, unigram_loss

BASE_BATCH = 64
LARGE = 8  # the large batch is LARGE x BASE_BATCH
WORKERS = 2
FULL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "text_bytes": 500_000, "epochs": 6}
QUICK = {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32, "text_bytes": 20_000, "epochs": 1}
QUICK_ARMS = ("default", "lamb-8x")  # each run costs ~10 s of start-up: the judged pair only
WARMUP_EPOCHS = 0.1  # per epoch of the run: warm-up over the first tenth of the samples
WEIGHT_DECAY = 0.01
TEST_FRACTION = 0.2
WITHIN = 0.02  # the bar: LAMB's validation loss at most 2% above the default's
# Tuned rates, per batch of 64 (see --sweep and results/large_batch_sweep.json).
LR = {"default": 4e-3, "lamb-8x": 4e-3, "lars-8x": 4.0}
SWEEP = {"default": (2e-3, 4e-3, 8e-3), "lamb-8x": (4e-3, 8e-3, 1.6e-2), "lars-8x": (0.25, 0.5, 1.0),
         "adamw-8x": (5e-4, 1e-3, 2e-3)}


@dataclass(frozen=True)
class Arm:
    name: str
    batch: int
    optimizer: str
    tuned: str  # whose entry of LR this arm runs at (adamw-8x: the default's, scaled by the rule)

    def sets(self, lr: float, warmup_steps: int) -> list[str]:
        out = [f"data.batch_size={self.batch}", f"optim.name={self.optimizer}", f"optim.lr={lr:g}",
               "optim.schedule=cosine", f"optim.warmup_steps={warmup_steps}",
               f"optim.weight_decay={WEIGHT_DECAY}", f"optim.base_batch={BASE_BATCH}",
               f"optim.scale_lr={str(self.batch != BASE_BATCH).lower()}"]
        if self.optimizer == "lars":
            out.append("optim.momentum=0.9")
        return out


ARMS = (Arm("default", BASE_BATCH, "adamw", "default"), Arm("lamb-8x", LARGE * BASE_BATCH, "lamb", "lamb-8x"),
        Arm("lars-8x", LARGE * BASE_BATCH, "lars", "lars-8x"),
        Arm("adamw-8x", LARGE * BASE_BATCH, "adamw", "default"))


def common_sets(size: dict[str, Any]) -> list[str]:
    return ["model.name=gpt", "data.name=text", f"model.n_layers={size['n_layers']}",
            f"model.d_model={size['d_model']}", f"model.n_heads={size['n_heads']}",
            f"data.seq_len={size['seq_len']}", f"data.text_bytes={size['text_bytes']}",
            f"data.test_fraction={TEST_FRACTION}", f"optim.epochs={size['epochs']}", "run.seed=0",
            "run.log_every=1000"]


def warmup_steps(n_train: int, batch: int, epochs: int) -> int:
    """Warm-up steps covering WARMUP_EPOCHS of each epoch's samples (short last batch counted)."""
    per_epoch = -(-n_train // batch)
    return int(round(WARMUP_EPOCHS * epochs * per_epoch))


def run_arm(out: Path, arm: Arm, lr: float, size: dict[str, Any], n_train: int, label: str) -> dict[str, Any]:
    warm = warmup_steps(n_train, arm.batch, size["epochs"])
    start = time.perf_counter()
    summary = train(out, label, ["--nproc", str(WORKERS)],
                    sets=[*common_sets(size), *arm.sets(lr, warm)])
    wall = time.perf_counter() - start
    return {"optimizer": arm.optimizer, "batch": arm.batch, "lr": lr,
            "effective_lr": lr * arm.batch / BASE_BATCH, "warmup_steps": warm,
            "val_loss": summary["val_loss"], "next_byte_accuracy": summary["test_accuracy"],
            "final_train_loss": summary["final_loss"], "steps": summary["steps"],
            "wall_seconds": round(wall, 1), "train_seconds": round(summary["train_seconds"], 1)}


def judge(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each run's validation loss over the default's; is LAMB within WITHIN?"""
    base = runs["default"]["val_loss"]
    ratios = {name: round(row["val_loss"] / base, 4) for name, row in runs.items()}
    for name, row in runs.items():
        row["ratio_to_default"] = ratios[name]
    return {"ratio_to_default": ratios, "lamb_within_2pct": ratios["lamb-8x"] <= 1 + WITHIN,
            "bar": 1 + WITHIN}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, one epoch, default and LAMB only: a smoke run")
    parser.add_argument("--no-lars", action="store_true", help="leave the (optional) LARS arm out")
    parser.add_argument("--sweep", action="store_true", help="every arm at every rate of SWEEP (tuning)")
    parser.add_argument("--text-bytes", type=int, default=None,
                        help="training bytes instead of FULL's (more steps per arm; rates stay as tuned)")
    parser.add_argument("--rates", action="append", default=[], metavar="ARM=LR[,LR...]",
                        help="with --sweep: these arms only, at these rates (extending a grid at its edge)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.rates and not args.sweep:
        parser.error("--rates goes with --sweep")
    grid = {name: tuple(float(r) for r in rates.split(",")) for name, rates in
            (item.split("=", 1) for item in args.rates)} or SWEEP
    size = dict(QUICK if args.quick else FULL)
    if args.text_bytes is not None:
        size["text_bytes"] = args.text_bytes
    arms = [a for a in ARMS if not (args.no_lars and a.name == "lars-8x")]
    if args.quick:
        arms = [a for a in arms if a.name in QUICK_ARMS]
    split = load_text(seq_len=size["seq_len"], text_bytes=size["text_bytes"], test_fraction=TEST_FRACTION)
    n_train = len(split.x_train)
    report: dict[str, Any] = {
        "size": size, "workers": WORKERS, "base_batch": BASE_BATCH, "large_batch": LARGE * BASE_BATCH,
        "train_samples": n_train, "eval_samples": len(split.x_test), "warmup_epochs": WARMUP_EPOCHS,
        "weight_decay": WEIGHT_DECAY, "schedule": "cosine", "unigram_loss": round(unigram_loss(split), 4),
        "runs": {}}
    console = Console(width=140)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="paraloom-largebatch-") as tmp:
        if args.sweep:
            report["sweep"] = {}
            for arm in (a for a in arms if a.name in grid):
                for lr in grid[arm.name]:
                    row = run_arm(Path(tmp), arm, lr, size, n_train, f"{arm.name}-{lr:g}")
                    report["sweep"].setdefault(arm.name, {})[f"{lr:g}"] = row
                    console.print(f"{arm.name:9s} lr {lr:<7g} val_loss {row['val_loss']:.4f} "
                                  f"steps {row['steps']} {row['wall_seconds']} s")
                    write_json(args.json, report)
            report["best_lr"] = {name: min(rows, key=lambda k: rows[k]["val_loss"])
                                 for name, rows in report["sweep"].items()}
            report["seconds"] = round(time.perf_counter() - started, 1)
            console.print_json(data=report["best_lr"])
            write_json(args.json, report)
            return 0
        for arm in arms:
            row = run_arm(Path(tmp), arm, LR[arm.tuned], size, n_train, arm.name)
            report["runs"][arm.name] = row
            console.print(f"{arm.name:9s} val_loss {row['val_loss']:.4f} steps {row['steps']} "
                          f"{row['wall_seconds']} s")
            write_json(args.json, report)  # a partial run keeps its rows
    report["summary"] = judge(report["runs"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    table = make_table(f"byte-level GPT {size['n_layers']}x{size['d_model']} on text, {WORKERS} workers, "
                       f"{size['epochs']} epochs (unigram loss {report['unigram_loss']:.3f})",
                       ("run", "optimizer", "batch", "lr (eff.)", "warm-up", "steps", "val loss",
                        "vs default", "wall s"), left=("run", "optimizer"))
    for name, row in report["runs"].items():
        table.add_row(name, row["optimizer"], str(row["batch"]), f"{row['effective_lr']:g}",
                      str(row["warmup_steps"]), str(row["steps"]), f"{row['val_loss']:.4f}",
                      f"{row['ratio_to_default']:.4f}", f"{row['wall_seconds']:.0f}")
    console.print(table)
    verdict = "within" if report["summary"]["lamb_within_2pct"] else "NOT within"
    console.print(f"LAMB at {LARGE}x: val loss ratio {report['summary']['ratio_to_default']['lamb-8x']:.4f}, "
                  f"{verdict} 2% of the default batch's")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

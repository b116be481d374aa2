"""Same-run A/B of two source trees: the default job's wall time, the data-parallel schedulers' step
times and the model-parallel plans' step times, each tree's runs interleaved (A B, B A, ...).

    python benchmarks/loop_ab.py --new /work/main --base /tmp/base --pairs 5 --json out.json

A tree is a checkout; its `src/` goes first on PYTHONPATH, so both run in this virtual environment.
Every figure is a median over the runs of a tree; `pairs` is the range of the per-pair ratios
new / base. A change to the training loop or its strategies should leave every ratio within noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import make_table, write_json
from rich.console import Console

GPT = ("--set", "model.name=gpt", "--set", "data.name=text", "--set", "data.seq_len=64",
       "--set", "model.n_layers=4", "--set", "model.d_model=128", "--set", "model.n_heads=4",
       "--set", "data.batch_size=32")  # benchmarks/model_parallel.py's GPT
MP_PLANS = {
    "pp2 1f1b m8": ("--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.schedule=1f1b",
                    "--set", "parallel.microbatches=8"),
    "pp2 gpipe m8": ("--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.schedule=gpipe",
                     "--set", "parallel.microbatches=8"),
    "tp2": ("--nproc", "2", "--set", "parallel.tp=2"),
    "dp2 x pp2 1f1b m4": ("--nproc", "4", "--set", "parallel.pp=2", "--set", "parallel.schedule=1f1b",
                          "--set", "parallel.microbatches=4"),
    "layers 2": ("--nproc", "2", "--set", "parallel.mode=layers"),
}
DP_VARIANTS = ("ddp", "wait_free", "fifo", "priority", "one_step_delay", "local_sgd")
DP_CODE = ("from paraloom.bench.dp_schedulers import run; import json; print(json.dumps(run(nproc=2, "
           "hidden=1024, depth=9, batch=64, rounds=3, variants={v!r})['seconds']))")  # its loopback case (c)


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src")}


def train(tree: Path, out: Path, name: str, args: tuple[str, ...]) -> tuple[float, dict[str, Any]]:
    """(wall seconds of the whole process, summary) of one `paraloom train` run from `tree`."""
    cmd = [sys.executable, "-m", "paraloom", "train", *args, "--set", f"run.out_dir={out}",
           "--set", f"run.name={name}"]
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env_for(tree), timeout=1200)
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return wall, json.loads((out / name / "summary.json").read_text())


def dp_seconds(tree: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", DP_CODE.format(v=DP_VARIANTS)], capture_output=True,
                          text=True, env=env_for(tree), timeout=1200)
    if done.returncode:
        raise SystemExit(f"dp_schedulers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleave(pairs: int, run_one) -> dict[str, list[float]]:
    """`run_one(side, i)` -> {figure: value}, called A B, B A, ... for `pairs` pairs, after a warm-up
    run of each tree."""
    run_one("new", -1), run_one("base", -1)
    out: dict[str, list[float]] = {}
    for i in range(pairs):
        for side in (("new", "base") if i % 2 == 0 else ("base", "new")):
            for figure, value in run_one(side, i).items():
                out.setdefault(f"{side}/{figure}", []).append(value)
    return out


def ratios(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    figures = sorted({key.split("/", 1)[1] for key in runs})
    table = {}
    for figure in figures:
        new, base = runs[f"new/{figure}"], runs[f"base/{figure}"]
        per_pair = [a / b for a, b in zip(new, base, strict=True)]
        table[figure] = {"new": statistics.median(new), "base": statistics.median(base),
                         "ratio": statistics.median(new) / statistics.median(base),
                         "pair_min": min(per_pair), "pair_max": max(per_pair)}
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--mp-steps", type=int, default=40)
    parser.add_argument("--parts", default="default,dp,mp")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/loop_ab.json"))
    args = parser.parse_args(argv)
    trees = {"new": args.new.resolve(), "base": args.base.resolve()}
    report: dict[str, Any] = {"trees": {k: str(v) for k, v in trees.items()}, "pairs": args.pairs}
    console = Console()
    with tempfile.TemporaryDirectory(prefix="paraloom-ab-") as tmp:
        out = Path(tmp)
        count = iter(range(10**6))
        parts = args.parts.split(",")
        if "default" in parts:
            def default(side: str, i: int) -> dict[str, float]:
                wall, summary = train(trees[side], out, f"d{next(count)}", ())
                return {"wall_seconds": wall, "test_accuracy": summary["test_accuracy"]}
            report["default"] = ratios(interleave(args.pairs, default))
        if "dp" in parts:
            report["dp_schedulers"] = ratios(interleave(args.pairs, lambda side, i: dp_seconds(trees[side])))
        if "mp" in parts:
            def mp(side: str, i: int) -> dict[str, float]:
                return {plan: train(trees[side], out, f"m{next(count)}",
                                    (*plan_args, *GPT, "--set", f"optim.max_steps={args.mp_steps}",
                                     "--set", "run.checkpoint_every=0", "--set", "run.save_model=false"))[1]
                        ["step_seconds"] for plan, plan_args in MP_PLANS.items()}
            report["model_parallel"] = ratios(interleave(args.pairs, mp))
    write_json(args.json, report)
    for part in ("default", "dp_schedulers", "model_parallel"):
        if part not in report:
            continue
        table = make_table(f"{part}: new / base", ["figure", "new", "base", "ratio", "pairs"],
                           left=["figure"])
        for figure, row in report[part].items():
            table.add_row(figure, f"{row['new']:.4g}", f"{row['base']:.4g}", f"{row['ratio']:.3f}",
                          f"{row['pair_min']:.3f}-{row['pair_max']:.3f}")
        console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

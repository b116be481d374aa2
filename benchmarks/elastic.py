"""Elastic training, measured: a node lost for good and one that returns, and what checkpoints cost.

    python benchmarks/elastic.py [--seeds 3] [--parts membership,cost] --json OUT   (the cluster: root)

Membership: digits on an emulated 4 x 1 Gbit/s cluster, `run.nodes=3..4`, a checkpoint every 20
steps, per seed an uninterrupted run and one with `--inject lose:node=3,step=50` (the node's agent
and worker SIGKILLed as step 50 begins, never started again); then one run where the node comes
back (`back=0`: started again once the others resumed without it). Acceptance: the lost-node runs
finish on 3 nodes, redo at most 20 steps, and their mean final test accuracy is within 0.5 pt of
the uninterrupted runs' mean; the returning node's run grows back to 4; no namespace or process
left behind.

Checkpoint cost: the default job (`make run`: `paraloom train` as it comes, a checkpoint every 50
steps and at the end), `--seeds` runs each with synchronous and asynchronous saving, interleaved:
the seconds the training loop spent saving over its training seconds (medians).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import make_table, train, write_json
from rich.console import Console

DIGITS = ["model.name=mlp", "data.batch_size=64", "optim.epochs=10", "run.checkpoint_every=20",
          "run.log_every=100", "run.nodes=3..4", "run.hardware=none"]
CLUSTER = ["--emulate", "4x1gbit"]
EVERY = 20


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("plm-")}


def membership(out: Path, seeds: int, console: Console) -> dict:
    runs = []
    for seed in range(seeds):
        for name, inject in (("straight", None), ("lost", "lose:node=3,step=50")):
            console.print(f"[seed {seed}] {name}")
            args = [*CLUSTER] + (["--inject", inject] if inject else [])
            s = train(out, f"{name} {seed}", args, sets=[*DIGITS, f"run.seed={seed}"], checkpoints=True)
            runs.append({"case": name, "seed": seed, "world_size": s["world_size"],
                         "test_accuracy": s["test_accuracy"], "steps_redone": s["steps_redone"],
                         "resizes": s["resizes"], "wall_seconds": s["wall_seconds"]})
    console.print("[back] lose:node=3,step=50,back=0")
    s = train(out, "back", [*CLUSTER, "--inject", "lose:node=3,step=50,back=0"],
              sets=[*DIGITS, "optim.epochs=40"], checkpoints=True)
    back = {"world_size": s["world_size"], "resizes": s["resizes"], "steps_redone": s["steps_redone"],
            "test_accuracy": s["test_accuracy"]}
    straight = [r["test_accuracy"] for r in runs if r["case"] == "straight"]
    lost = [r for r in runs if r["case"] == "lost"]
    gap = statistics.mean(r["test_accuracy"] for r in lost) - statistics.mean(straight)
    return {"runs": runs, "back": back, "accuracy_gap_pt": 100 * gap,
            "lost_finish_on_3": all(r["world_size"] == 3 for r in lost),
            "max_steps_redone": max(r["steps_redone"] for r in lost),
            "back_grows_to_4": back["world_size"] == 4 and [(r["old_world_size"], r["new_world_size"])
                                                           for r in back["resizes"]] == [(4, 3), (3, 4)]}


def checkpoint_cost(out: Path, seeds: int, console: Console) -> dict:
    """Each mode's seconds in the loop's saving over its training seconds, and as an A/B the training
    seconds against runs that save only at the end (`run.checkpoint_every=0`): what saving costs
    the run, a background writer's share of the cores included."""
    runs = []
    modes = {"end only": ["run.checkpoint_every=0"], "sync": [], "async": ["run.async_checkpoint=true"]}
    for i in range(seeds):
        for mode, sets in modes.items():  # interleaved: the machine's drift hits every mode alike
            console.print(f"[{i}] default job, {mode}")
            s = train(out, f"default {i} {mode}", [], checkpoints=True, sets=["run.hardware=none", *sets])
            runs.append({"mode": mode, "checkpoint_seconds": s["checkpoint_seconds"],
                         "train_seconds": s["train_seconds"], "steps": s["steps"]})

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    base = median("end only", "train_seconds")
    return {"runs": runs,
            "share_of_training": {mode: statistics.median(r["checkpoint_seconds"] / r["train_seconds"]
                                                          for r in runs if r["mode"] == mode)
                                  for mode in ("sync", "async")},
            "train_seconds_over_end_only": {mode: median(mode, "train_seconds") / base
                                            for mode in ("sync", "async")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parts", default="membership,cost")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    console = Console(width=150)
    before = namespaces()
    parts = args.parts.split(",")
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="paraloom-elastic-") as tmp:
        out = Path(tmp)
        if "membership" in parts:
            report["membership"] = membership(out, args.seeds, console)
            write_json(args.json, report)
        if "cost" in parts:
            report["checkpoint_cost"] = checkpoint_cost(out, args.seeds, console)
    left = subprocess.run(["pgrep", "-f", "torch.distributed.run"], capture_output=True, text=True).stdout
    report["left_behind"] = {"namespaces": sorted(namespaces() - before), "processes": left.split()}
    write_json(args.json, report)
    table = make_table("elastic training", ("figure", "measured", "bar"), left=("figure",))
    if "membership" in report:
        m = report["membership"]
        table.add_row("lost node: runs finish on 3 nodes", str(m["lost_finish_on_3"]), "True")
        table.add_row("lost node: steps redone (max)", str(m["max_steps_redone"]), f"<= {EVERY}")
        gap = f"{m['accuracy_gap_pt']:+.2f} pt"
        table.add_row("lost node: mean accuracy - uninterrupted's", gap, "within 0.5 pt")
        table.add_row("returning node: 4 -> 3 -> 4", str(m["back_grows_to_4"]), "True")
    cost = report.get("checkpoint_cost", {})
    for mode, share in cost.get("share_of_training", {}).items():
        table.add_row(f"checkpoints' share of the default job ({mode})", f"{share:.2%}", "<= 5%")
        ratio = cost["train_seconds_over_end_only"][mode]
        table.add_row(f"training seconds against saving at the end only ({mode})", f"{ratio:.3f}", "<= 1.05")
    table.add_row("left behind", str(report["left_behind"]), "nothing")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

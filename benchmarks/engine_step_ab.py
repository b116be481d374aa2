"""Same-run A/B of the engine's per-step host work in two source trees: many small layers, DDP's loop.

    python benchmarks/engine_step_ab.py --new /work/main --base /tmp/base --pairs 3 --json out.json

A step of a deep stack of small layers (40 x Linear(64, 64), batch 8, 2 ranks on loopback, wait_free)
is mostly the engine's own Python: a hook per parameter, the end-of-backward wait, the forward's
checks. Each tree runs in a process group of its own (its `src/` first on PYTHONPATH), the trees
alternating pair by pair; a run's figure is the median of `blocks` blocks of `steps` steps
(slowest rank). A change to the engine's hot path should leave new / base within noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import write_json

WORKER = """
import json, statistics, sys, time
sys.path.insert(0, {tests!r})
import torch
from distributed import run_workers

def measure(rank, world, steps, blocks):
    import paraloom
    from torch import nn
    assert paraloom.__file__.startswith({tree!r}), paraloom.__file__
    torch.manual_seed(0)
    model = paraloom.DataParallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)

print(json.dumps(max(run_workers(measure, 2, {steps}, {blocks}, timeout=600))))
"""


def one_run(tree: Path, steps: int, blocks: int) -> float:
    """Seconds a step (slowest rank's median block) with `tree`'s paraloom."""
    code = WORKER.format(tests=str(Path(__file__).resolve().parents[1] / "tests"), tree=str(tree / "src"),
                         steps=steps, blocks=blocks)
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=Path, required=True, help="the changed tree")
    parser.add_argument("--base", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {"new": [], "base": []}
    for pair in range(args.pairs):
        order = ("new", "base") if pair % 2 == 0 else ("base", "new")  # A B, B A, ...
        for which in order:
            runs[which].append(one_run(getattr(args, which).resolve(), args.steps, args.blocks))
    ratios = [n / b for n, b in zip(runs["new"], runs["base"], strict=True)]
    new, base = statistics.median(runs["new"]), statistics.median(runs["base"])
    report = {"new": str(args.new), "base": str(args.base), "seconds": runs, "median_new_s": new,
              "median_base_s": base, "ratio_new_over_base": new / base, "pair_ratios": ratios}
    print(json.dumps({k: v for k, v in report.items() if k != "seconds"}, indent=1))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

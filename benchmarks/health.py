"""Online straggler attribution, measured: who is named, for what, how soon, and what the checks cost.

    python benchmarks/health.py [--runs 5] --json OUT          (the emulated cluster needs root)

Cases, each `--runs` times, the slow rank moving from run to run (1, 2, 3, 1, ...):
  slow loopback      data parallel, 4 workers on loopback, `--inject slow:rank=R,factor=2`
  slow cluster       the same on an emulated 4 x 1 Gbit/s cluster
  slow dp2xpp2       a dp2 x pp2 GPT, 4 workers on loopback, the same fault
  slow_data loopback data parallel, 4 workers, `--inject slow_data:rank=R,factor=2`
  clean loopback     data parallel, 4 workers, no fault
Acceptance: the slow rank named within 30 steps with "compute" (slow) or "input" (slow_data) in
every run; no one named in any clean run. Checks every 10 steps (the default); 80 steps a run.
The checks' cost is what the rank that reached them last spent in them (`health_seconds`: the
all-gather and the judging, no wait for a slower rank) over the training time, and, as an A/B,
clean runs' throughput with checks against without (`run.health_every=0`), interleaved, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import make_table, train, write_json
from rich.console import Console

MLP = ["model.name=mlp", "model.hidden=512", "model.depth=3", "data.batch_size=128", "optim.max_steps=80",
       "run.log_every=10", "run.save_model=false"]
GPT = ["model.name=gpt", "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "data.name=text",
       "data.seq_len=32", "data.batch_size=16", "data.text_bytes=100000", "parallel.pp=2",
       "parallel.microbatches=2", "optim.max_steps=80", "run.log_every=10", "run.save_model=false"]
CASES = {  # name: (launch, settings, fault or None, the term to name)
    "slow loopback": (["--nproc", "4"], MLP, "slow:rank={r},factor=2", "compute"),
    "slow cluster": (["--emulate", "4x1gbit"], MLP, "slow:rank={r},factor=2", "compute"),
    "slow dp2xpp2": (["--nproc", "4"], GPT, "slow:rank={r},factor=2", "compute"),
    "slow_data loopback": (["--nproc", "4"], MLP, "slow_data:rank={r},factor=2", "input"),
    "clean loopback": (["--nproc", "4"], MLP, None, None),
}
WITHIN = 30


def one(out: Path, name: str, i: int) -> dict:
    launch, sets, fault, term = CASES[name]
    rank = 1 + i % 3
    args = [*launch] + (["--inject", fault.format(r=rank)] if fault else [])
    summary = train(out, f"{name} {i}", args, sets=[*sets, "run.hardware=none"])
    named = summary["stragglers"]
    first = named[0] if named else None
    if fault is None:
        ok = not named
    else:
        ok = first is not None and (first["rank"], first["term"]) == (rank, term) and first["step"] <= WITHIN
    return {"case": name, "run": i, "slow_rank": rank if fault else None, "named": named, "ok": ok,
            "health_seconds": summary["health_seconds"], "train_seconds": summary["train_seconds"],
            "samples_per_second": summary["samples_per_second"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    console = Console(width=150)
    report: dict = {"runs": [], "ab": []}
    cases = [c.strip() for c in args.cases.split(",")]
    with tempfile.TemporaryDirectory(prefix="paraloom-health-") as tmp:
        out = Path(tmp)
        for i in range(args.runs):  # interleaved: the machine's drift hits every case alike
            for name in cases:
                console.print(f"[{i + 1}/{args.runs}] {name}")
                report["runs"].append(one(out, name, i))
                write_json(args.json, report)
            for every in (10, 0):  # the checks' cost, A/B
                s = train(out, f"ab {every} {i}", ["--nproc", "4"],
                          sets=[*MLP, "run.hardware=none", f"run.health_every={every}"])
                report["ab"].append({"health_every": every, "samples_per_second": s["samples_per_second"]})
    table = make_table("straggler attribution", ("case", "named in", "first named (rank, term, step)",
                                                 "checks' share of training"), left=("case", "first named"))
    summary = {}
    for name in cases:
        rows = [r for r in report["runs"] if r["case"] == name]
        share = statistics.median(r["health_seconds"] / r["train_seconds"] for r in rows)
        summary[name] = {"ok": sum(r["ok"] for r in rows), "runs": len(rows), "checks_share": share}
        firsts = [(r["named"][0]["rank"], r["named"][0]["term"], r["named"][0]["step"]) if r["named"] else "-"
                  for r in rows]
        table.add_row(name, f"{summary[name]['ok']}/{len(rows)}", " ".join(map(str, firsts)), f"{share:.2%}")
    on = statistics.median(r["samples_per_second"] for r in report["ab"] if r["health_every"])
    off = statistics.median(r["samples_per_second"] for r in report["ab"] if not r["health_every"])
    summary["ab_throughput_with_over_without"] = on / off
    pairs = zip(report["ab"][::2], report["ab"][1::2], strict=True)  # (with, without), run back to back
    summary["ab_paired_ratio_median"] = statistics.median(a["samples_per_second"] / b["samples_per_second"]
                                                          for a, b in pairs)
    report["summary"] = summary
    console.print(table)
    console.print_json(data=summary)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

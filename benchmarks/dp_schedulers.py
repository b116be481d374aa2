"""Data-parallel step time: paraloom's schedulers and sync modes against torch DDP in the same run.

    python benchmarks/dp_schedulers.py [--quick] [--trace DIR] --json OUT

Model: a layered MLP on digits, 8.47M parameters (9 hidden layers of 1024; 34 MB of fp32
gradients), SGD with momentum, 25 MB buckets for DDP and paraloom alike. Variants: torch DDP
(as is, and with gradient_as_bucket_view), paraloom fifo, wait_free, priority, auto (each of
the three tried for a few steps, the fastest kept: its trials run as warm-up, and the summary
holds its ratio to the best fixed scheduler per case), one_step_delay and local_sgd (H = 4).
Cases (the emulated ones need root):
  (a) balanced: 2 workers on an emulated cluster whose bandwidth is chosen so that one
      all-reduce of all gradients takes as long as a step's computation (global batch 512);
      the bandwidth is calibrated by probes: a first guess from the computation time and the
      gradient bytes, corrected by the measured all-reduce/compute ratio until within 10%;
  (b) 4 workers on an emulated 1 Gbit/s cluster (global batch 64);
  (c) 2 workers on loopback (global batch 64).
"""

from __future__ import annotations

import argparse
import sys

from clusters import emulated
from common import make_table, write_json
from rich.console import Console

from paraloom.bench.dp_schedulers import DROP_IN, OPT_IN, SWITCHABLE, VARIANTS, run
from paraloom.cluster.spec import format_rate

MODEL = {"hidden": 1024, "depth": 9}
BALANCED_BATCH = 512


def balanced_case(size: dict, trace: str | None, max_probes: int = 3) -> dict:
    """Case (a): find the bandwidth where all-reduce time ~ compute time, then run every variant."""
    probe = {**size, "variants": (), "batch": BALANCED_BATCH}
    local = run(nproc=2, **probe)
    grad_bytes = 4 * local["params"]  # a 2-worker all-reduce puts about this much on each link
    rate = grad_bytes * 8 / local["seconds"]["compute"]
    probes = []
    for _ in range(max_probes):  # correct the guess by the measured ratio until within 10%
        with emulated(2, rate, "dp") as cluster:
            seconds = run(cluster=cluster, **probe)["seconds"]
        probes.append({"bits": cluster.spec.rate_bits, "compute_s": seconds["compute"],
                       "allreduce_s": seconds["allreduce"]})
        ratio = seconds["allreduce"] / seconds["compute"]
        rate *= ratio
        if abs(ratio - 1) < 0.1:
            break
    with emulated(2, rate, "dp") as cluster:
        out = run(cluster=cluster, **{**size, "batch": BALANCED_BATCH},
                  trace_dir=f"{trace}/balanced" if trace else None)
    out["bandwidth_bits"] = cluster.spec.rate_bits
    out["calibration"] = {"loopback_compute_s": local["seconds"]["compute"], "probes": probes}
    return out


def summarize(cases: dict, nodes: int) -> dict:
    """The headline ratios of the variants that ran."""
    balanced, cluster = cases["balanced_2"], cases[f"emulated_{nodes}x1gbit"]
    out = {"balanced_bandwidth": format_rate(balanced["bandwidth_bits"]),
           "balanced_bandwidth_bits": balanced["bandwidth_bits"]}
    if "ddp" in cluster["seconds"]:
        out["ratio_waitfree_vs_ddp"] = cluster["ratio_vs_ddp"]["wait_free"]
        out["ratio_waitfree_vs_ddp_loopback"] = cases["loopback_2"]["ratio_vs_ddp"]["wait_free"]
    for key, variant in (("ratio_priority_vs_waitfree", "priority"),
                         ("ratio_odsgd_vs_waitfree", "one_step_delay")):
        if variant in balanced["seconds"]:
            out[key] = balanced["ratio_vs_wait_free"][variant]
    fixed = ("fifo", "wait_free", "priority")
    if "auto" in balanced["seconds"] and all(v in balanced["seconds"] for v in fixed):
        # comm.scheduler=auto against the best of the three it chooses from, case by case
        out["ratio_auto_vs_best_fixed"] = {case: c["seconds"]["auto"] / min(c["seconds"][v] for v in fixed)
                                           for case, c in cases.items()}
        out["auto_chose"] = {case: c.get("auto_chose") for case, c in cases.items()}
        # the trials' medians, round by round, beside the fixed schedulers' whole runs above
        out["auto_trials"] = {case: c.get("auto_trials") for case, c in cases.items()}
    if "auto_bucket" in balanced["seconds"] and all(v in balanced["seconds"] for v in fixed):
        # comm.bucket_mb=auto as well: against the best fixed scheduler at the given bucket size
        out["ratio_auto_bucket_vs_best_fixed"] = {case: c["seconds"]["auto_bucket"] / min(
            c["seconds"][v] for v in fixed) for case, c in cases.items()}
        out["auto_bucket_chose"] = {case: c.get("auto_bucket_chose") for case, c in cases.items()}
    for variant, base in (("drop_in", "wait_free"), ("priority_drop_in", "priority")):
        if variant in balanced["seconds"] and base in balanced["seconds"]:
            out[f"ratio_{variant}_vs_{base}"] = {case: c["seconds"][variant] / c["seconds"][base]
                                                 for case, c in cases.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps: a smoke run")
    parser.add_argument("--trace", metavar="DIR", help="write Chrome traces of paraloom's variants here")
    known = VARIANTS + DROP_IN + OPT_IN
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(known)} (wait_free always runs), or A>B with "
                        f"A, B of {', '.join(SWITCHABLE)}: built as A, switched to B as auto switches, timed")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant in turn (median)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps of a variant per round (their mean is the round's figure; more "
                        "steps, steadier rounds where long steps come in bursts)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    variants = tuple(dict.fromkeys(["wait_free", *args.variants.split(",")]))
    switched = {f"{a}>{b}" for a in SWITCHABLE for b in SWITCHABLE}  # built as A, timed after a switch to B
    unknown = set(variants) - set(known) - switched
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(known)}")
    size = {**MODEL, "rounds": args.rounds, "steps": args.steps, "variants": variants}
    if args.quick:
        size = {"hidden": 128, "depth": 2, "steps": 3, "warmup": 2, "rounds": 1, "variants": variants}
    cases = {"balanced_2": balanced_case(size, args.trace, max_probes=1 if args.quick else 3)}
    nodes = 2 if args.quick else 4
    with emulated(nodes, 10**9, "dp") as cluster:
        trace = f"{args.trace}/{nodes}x1gbit" if args.trace else None
        cases[f"emulated_{nodes}x1gbit"] = run(cluster=cluster, **size, trace_dir=trace)
    cases["loopback_2"] = run(nproc=2, **size, trace_dir=f"{args.trace}/loopback" if args.trace else None)
    report = {
        "model": {**MODEL, "params": cases["loopback_2"]["params"]} if not args.quick else size,
        "cases": cases,
        "summary": summarize(cases, nodes),
    }
    table = make_table("median step time, slowest rank (ms); (ratio to DDP / to wait_free)",
                       ("case", "compute", "all-reduce", "bound", *variants))
    for case, out in cases.items():
        s, r, w = out["seconds"], out["ratio_vs_ddp"], out["ratio_vs_wait_free"]
        label = case if case != "balanced_2" else f"balanced_2 @ {format_rate(out['bandwidth_bits'])}"
        table.add_row(label, f"{s['compute'] * 1e3:.0f}", f"{s['allreduce'] * 1e3:.0f}",
                      f"{out['bound'] * 1e3:.0f}",
                      *[f"{s[v] * 1e3:.0f} ({r.get(v, float('nan')):.2f}/{w[v]:.2f})" for v in variants])
    Console(width=200).print(table)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

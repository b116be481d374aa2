"""Gradient compression on a communication-bound model: every compressor against torch DDP, same run.

    python benchmarks/compression.py [--quick] [--loopback] [--rows 1gbit] [--variants A,B] --json OUT

Model and recipe: a wide MLP on digits (3 hidden layers of 2048, 8.5M parameters, 34 MB of fp32
gradients), momentum SGD (0.9) at lr 0.03 with a cosine decay to zero over 10 epochs, global
batch 32 (8 per worker), 4 workers, 25 MB buckets, test accuracy every quarter epoch; the same
seed, initial weights and data order for every variant. At 1 Gbit/s one fp32 all-reduce of the
gradients takes ~430 ms and a step's computation ~100 ms (4 workers share 2 cores): the link is
the bottleneck, as on the clusters this benchmark stands for.
Rows (the emulated ones need root): 4 nodes at 1 Gbit/s, every variant; 4 nodes at 10 Gbit/s,
every variant but the four whose encode+decode alone costs more than DDP's whole 1 Gbit/s step
on this CPU (qsgd, onebit, efsign, randomk: 250-310 ms single-threaded; listed in SLOW_CODECS),
which therefore cannot help on a faster link (`--loopback`: 4 workers on loopback, one row).
Variants, taking turns in one process group (paraloom.bench.compression_speed): torch DDP fp32, DDP with
torch's fp16_compress_hook, paraloom's wait_free engine uncompressed, and the engine with every
registered compressor at its defaults (DGC with momentum correction, which replaces the
optimizer's momentum) plus PowerSGD at rank 4 from the third step, and top-k and DGC at density
0.001 (DGC with the paper's four warm-up densities, one step each).
Per variant: wire ratio (fp32 gradient bytes / payload bytes handed to collectives per step),
mean step time (slowest rank, evaluation excluded), time to `TARGET` test accuracy (training
time up to the first evaluation that reaches it; null if none does), final test accuracy after
the last epoch, and encode+decode time per step (measured after training, apart from it).
Summary (1 Gbit/s row): best TTA speedup over DDP fp32 and its variant; the wire ratio and
accuracy drop (points, vs DDP fp32) of the better of topk_0.001 / dgc_0.001 (better: the higher
final accuracy); paraloom fp16's step time over DDP fp32's; and the variants whose TTA still
beats DDP fp32's at 10 Gbit/s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clusters import emulated
from common import make_table, write_json
from rich.console import Console

from paraloom.bench.compression_speed import VARIANTS, run

MODEL = {"hidden": 2048, "depth": 3, "batch": 32, "lr": 0.03, "optimizer": "sgd", "cosine": True,
         "evals_per_epoch": 4}
TARGET = 0.93  # DDP on this model first reaches it after ~2.2 of 10 epochs
EPOCHS = 10
QUICK = {"hidden": 256, "epochs": 2, "evals_per_epoch": 2,
         "variants": ("ddp", "ddp_fp16", "wait_free", "fp16", "qsgd", "powersgd", "powersgd_4", "topk_0.001",
                      "dgc_0.001")}
ROWS = {"1gbit": 10**9, "10gbit": 10**10}
SLOW_CODECS = ("qsgd", "onebit", "efsign", "randomk")
SPARSE = ("topk_0.001", "dgc_0.001")


def annotate(row: dict[str, Any]) -> None:
    """Add speedup and accuracy drop against DDP fp32 to every variant of a row."""
    results = row["variants"]
    ddp = results.get("ddp")
    for out in results.values():
        both = ddp is not None and ddp["tta_s"] is not None and out["tta_s"] is not None
        out["tta_speedup_vs_ddp"] = ddp["tta_s"] / out["tta_s"] if both else None
        out["acc_drop_pt_vs_ddp"] = 100 * (ddp["final_accuracy"] - out["final_accuracy"]) if ddp else None
        out["step_ratio_vs_ddp"] = out["step_s"] / ddp["step_s"] if ddp else None


def summarize(main_row: dict[str, Any], fast_row: dict[str, Any] | None) -> dict[str, Any]:
    results = main_row["variants"]
    reached = {v: out for v, out in results.items() if out["tta_s"] is not None}
    best = min(reached, key=lambda v: reached[v]["tta_s"]) if reached else None
    sparse = [v for v in SPARSE if v in results]
    chosen = max(sparse, key=lambda v: results[v]["final_accuracy"]) if sparse else None
    helps = None
    if fast_row is not None:
        fast = fast_row["variants"]
        ddp_tta = fast.get("ddp", {}).get("tta_s")
        helps = [v for v, out in fast.items() if v != "ddp" and out["tta_s"] is not None
                 and (ddp_tta is None or out["tta_s"] < ddp_tta)]
    return {
        "target_accuracy": main_row["recipe"]["target"],
        "best_tta_variant": best,
        "best_tta_speedup_vs_ddp": results[best]["tta_speedup_vs_ddp"] if best else None,
        "topk_variant": chosen,
        "topk_wire_ratio": results[chosen]["wire_ratio"] if chosen else None,
        "topk_acc_drop_pt": results[chosen]["acc_drop_pt_vs_ddp"] if chosen else None,
        "fp16_step_ratio": (results["fp16"]["step_s"] / results["ddp"]["step_s"]
                            if "fp16" in results and "ddp" in results else None),
        "helps_at_10gbit": helps,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_row(console: Console, name: str, row: dict[str, Any]) -> None:
    table = make_table(f"{name}: {row['world_size']} workers, {row['params'] / 1e6:.2f}M params, "
                       f"compute {row['compute_s'] * 1e3:.0f} ms, fp32 all-reduce "
                       f"{row['allreduce_s'] * 1e3:.0f} ms; target {row['recipe']['target']:.2f}",
                       ("variant", "wire ratio", "step ms", "TTA s", "speedup vs ddp", "final acc",
                        "acc drop pt", "codec ms"))
    for variant, out in row["variants"].items():
        table.add_row(variant, f"{out['wire_ratio']:.1f}", f"{out['step_s'] * 1e3:.0f}",
                      _fmt(out["tta_s"], ".1f"), _fmt(out["tta_speedup_vs_ddp"], ".2f"),
                      f"{out['final_accuracy']:.3f}", _fmt(out["acc_drop_pt_vs_ddp"], "+.1f"),
                      f"{out['codec_s_per_step'] * 1e3:.1f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs, 7 variants: a smoke run")
    parser.add_argument("--loopback", action="store_true", help="4 workers on loopback (no root, no shaping)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"emulated rows to run (of {', '.join(ROWS)})")
    parser.add_argument("--variants", help="only these variants (comma-separated; default: all), e.g. the "
                        "judged ones for a confirmation run")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    rows_asked = args.rows.split(",")
    unknown = [r for r in rows_asked if r not in ROWS] + [v for v in (args.variants or "").split(",")
                                                         if v and v not in VARIANTS]
    if unknown:
        print(f"compression.py: unknown rows or variants: {', '.join(unknown)} (rows: {', '.join(ROWS)}; "
              f"variants: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    if "1gbit" not in rows_asked:
        print("compression.py: --rows must include 1gbit, the row the summary reads", file=sys.stderr)
        return 2
    size = {**MODEL, "target": TARGET, "epochs": EPOCHS, "variants": VARIANTS}
    if args.quick:
        size.update(QUICK)
    if args.variants:
        size["variants"] = tuple(v for v in size["variants"] if v in args.variants.split(","))
    console = Console(width=160)
    rows: dict[str, Any] = {}
    chosen = {"loopback": None} if args.loopback else {name: ROWS[name] for name in rows_asked}
    for name, rate in chosen.items():
        if rate is None:
            rows[name] = run(nproc=4, **size)
        else:
            fast = rate > 10**9 and not args.quick
            variants = tuple(v for v in size["variants"] if not (fast and v in SLOW_CODECS))
            with emulated(4, rate, "cmp") as cluster:
                rows[name] = run(cluster=cluster, **{**size, "variants": variants})
        annotate(rows[name])
        print_row(console, name, rows[name])  # each row as soon as it is done
        main_row = rows["loopback" if args.loopback else "1gbit"]
        report = {"model": {**MODEL, "hidden": size["hidden"], "params": main_row["params"]}, "rows": rows,
                  "summary": summarize(main_row, rows.get("10gbit"))}
        write_json(args.json, report)  # rewritten after every row: a partial run leaves its rows
    console.print_json(data=report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

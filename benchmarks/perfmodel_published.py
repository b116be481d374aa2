"""Performance model against published measurements of real GPU clusters.

    python benchmarks/perfmodel_published.py --json OUT [--cases FILE] [--only ID ...]

Each case in the case file (`benchmarks/published_cases.yaml`) is one published measurement with
its citation: the setup as published (hardware, model, batch, parallel layout, precision,
recomputation) and the figure measured (throughput per GPU in TFLOP/s, samples or tokens a second,
a scaling efficiency or speedup). Nothing in a case is derived from the measured figure. The model
predicts each case from its setup alone, with the hardware presets' data-sheet figures and assumed
efficiencies (no calibration on the machines measured, which are not at hand), and the report gives
each relative error, and per split (cases the model may be changed for, `fit`, and the `heldout`
ones it may not) the share within 15% and the median absolute error.

How a prediction becomes the published figure:
- `tflops_per_gpu` with `flops: megatron`: the FLOPs of a step by the formula the source used
  (Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h) with full recomputation,
  72 B s l h^2 (...) without), over the predicted step time and the number of GPUs;
- `samples_per_s` / `tokens_per_s`: the global batch (times the sequence) over the predicted step;
  `step_s`: the predicted step itself;
- `efficiency`: the predicted throughput over `gpus` times the predicted throughput of the case's
  `baseline` (usually one GPU with the same per-GPU batch); `speedup`: the throughput ratio itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from common import make_table, write_json
from rich.console import Console

from paraloom.errors import UserError
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.profile import profile_model
from paraloom.perfmodel.strategies import Options, Plan, estimate

CASES = Path(__file__).with_name("published_cases.yaml")
METRICS = ("tflops_per_gpu", "samples_per_s", "tokens_per_s", "step_s", "efficiency", "speedup")
PLAN_FIELDS = ("dp", "tp", "pp", "microbatches", "schedule", "virtual_stages", "scheduler", "compressor",
               "algorithm", "servers", "consistency")
WITHIN = 0.15


def hardware(raw: dict[str, Any], case: str) -> Hardware:
    """A case's hardware: a profile mapping as `paraloom plan --hardware` reads it."""
    return Hardware.from_yaml(yaml.safe_dump(raw), source=f"case {case!r} hardware")


def plan_of(raw: dict[str, Any], case: str) -> Plan:
    unknown = set(raw) - set(PLAN_FIELDS)
    if unknown:
        raise UserError(f"case {case!r}: plan fields {sorted(unknown)} are not known; "
                        f"choose from {PLAN_FIELDS}")
    return Plan(**raw)


def megatron_flops(model: dict[str, int], batch: int, recompute: bool) -> float:
    """FLOPs of one step by Narayanan et al. 2021, eq. 3 (72 without recomputation, 96 with)."""
    b, s, layers, h, v = batch, model["seq"], model["layers"], model["hidden"], model["vocab"]
    return (96 if recompute else 72) * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def spec_fields(spec: str) -> dict[str, int]:
    """The numbers of a `gpt:layers=..,hidden=..` spec."""
    _, _, rest = spec.partition(":")
    return {k: int(v) for k, v in (item.split("=") for item in rest.split(",") if "=" in item)}


def throughput(case: dict[str, Any], plan_raw: dict[str, Any], batch: int) -> tuple[float, Any]:
    """(samples a second, the estimate) of the case's model and hardware under `plan_raw`."""
    hw = hardware(case["hardware"], case["id"])
    profile = profile_model(case["model"], dtype=case.get("dtype", "fp32"),
                            recompute=case.get("recompute", "none"))
    est = estimate(profile, hw, plan_of(plan_raw, case["id"]), batch,
                   Options(optimizer=case.get("optimizer", "adam")))
    return batch / est.step_s, est


def predict(case: dict[str, Any]) -> dict[str, Any]:
    """The model's figure for one case, in the unit the source published."""
    measured = case["measured"]
    metric = measured["metric"]
    if metric not in METRICS:
        raise UserError(f"case {case['id']!r}: metric {metric!r} is not known; choose from {METRICS}")
    batch = int(case["batch"])
    rate, est = throughput(case, case["plan"], batch)
    gpus = case["plan"].get("dp", 1) * case["plan"].get("tp", 1) * case["plan"].get("pp", 1)
    if metric == "tflops_per_gpu":
        if measured.get("flops") != "megatron":
            raise UserError(f"case {case['id']!r}: tflops_per_gpu needs flops: megatron "
                            "(the source's formula)")
        flops = megatron_flops(spec_fields(case["model"]), batch, case.get("recompute", "none") == "full")
        value = flops / est.step_s / gpus / 1e12
    elif metric == "samples_per_s":
        value = rate
    elif metric == "step_s":
        value = est.step_s
    elif metric == "tokens_per_s":
        value = rate * spec_fields(case["model"])["seq"]
    else:
        base = case["baseline"]
        base_rate, _ = throughput(case, base["plan"], int(base["batch"]))
        value = rate / base_rate
        if metric == "efficiency":
            base_gpus = base["plan"].get("dp", 1) * base["plan"].get("tp", 1) * base["plan"].get("pp", 1)
            value /= gpus / base_gpus
    return {"predicted": value, "step_s": est.step_s, "bottleneck": est.bottleneck, "fits": est.fits,
            "memory_gib": est.memory_bytes / 2**30}


def summarize(rows: list[dict[str, Any]], split: str) -> dict[str, Any]:
    chosen = [r for r in rows if r["split"] == split]
    errors = [abs(r["error"]) for r in chosen]
    return {f"n_{split}": len(chosen),
            f"{split}_within_15pct": sum(e <= WITHIN for e in errors) / len(errors) if errors else None,
            f"{split}_median_abs_err": statistics.median(errors) if errors else None}


def run(cases_file: Path, only: list[str] | None = None) -> dict[str, Any]:
    data = yaml.safe_load(cases_file.read_text())
    sources, cases = data["sources"], data["cases"]
    rows = []
    for case in cases:
        if only and case["id"] not in only:
            continue
        if case["source"] not in sources:
            raise UserError(f"case {case['id']!r}: source {case['source']!r} is not among the sources")
        if case.get("split") not in ("fit", "heldout"):
            raise UserError(f"case {case['id']!r}: split must be fit or heldout")
        got = predict(case)
        measured = float(case["measured"]["value"])
        rows.append({"id": case["id"], "source": case["source"], "where": case.get("where", ""),
                     "split": case["split"], "kind": case.get("kind", ""),
                     "metric": case["measured"]["metric"], "measured": measured, **got,
                     "error": got["predicted"] / measured - 1})
    used = {r["source"] for r in rows}
    summary = {**summarize(rows, "heldout"), **summarize(rows, "fit"), "n_sources": len(used),
               "n_cases": len(rows)}
    all_errors = [abs(r["error"]) for r in rows]
    summary["all_median_abs_err"] = statistics.median(all_errors) if all_errors else None
    pending = data.get("pending") or []
    summary["n_pending"] = len(pending)
    return {"cases_file": str(cases_file), "sources": {k: sources[k] for k in sorted(used)}, "rows": rows,
            "pending": pending, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--cases", default=str(CASES))
    parser.add_argument("--only", nargs="*", help="these case ids alone")
    args = parser.parse_args(argv)
    try:
        report = run(Path(args.cases), args.only)
    except UserError as exc:
        print(f"perfmodel_published: error: {exc}", file=sys.stderr)
        return 2
    write_json(args.json, report)
    console = Console(width=140)
    table = make_table("the model against published measurements",
                       ("case", "split", "metric", "predicted", "measured", "error", "bottleneck"),
                       left=("case", "split", "metric", "bottleneck"))
    for r in report["rows"]:
        table.add_row(r["id"], r["split"], r["metric"], f"{r['predicted']:.4g}", f"{r['measured']:.4g}",
                      f"{r['error']:+.1%}", r["bottleneck"])
    console.print(table)
    for item in report["pending"]:
        console.print(f"[dim]not predicted: {item['id']} ({item['source']}, {item['where']}): "
                      f"{item['why']}[/dim]")
    console.print(report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

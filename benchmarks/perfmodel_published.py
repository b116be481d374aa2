"""Performance model against published measurements of real GPU clusters.

    python benchmarks/perfmodel_published.py --json OUT [--cases FILE] [--only ID ...]
    python benchmarks/perfmodel_published.py --json OUT --fit DEVICE.CLASS [...]

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

`--fit a100.matmul` fits a device preset's efficiency for one op class to the `fit` cases run on
that device (the value in 0.01 steps with the smallest median absolute error, then mean), and
reports it with those cases' errors before and after; it never reads a held-out case. What a
preset carries from such a fit says so beside the value. `--fit tensorflow-1.op_overhead_s` fits
a constant of a framework in `FRAMEWORKS` to the fit cases that name it, the same way, and
`--fit p100.winograd` a device preset's fp32 Winograd factor (a 1.00-4.00 grid in 0.05 steps: from
none to F(4x4, 3x3)'s 4).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from common import make_table, write_json
from rich.console import Console

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import OP_CLASSES, Hardware
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.plan import Options, Plan

CASES = Path(__file__).with_name("published_cases.yaml")
METRICS = ("tflops_per_gpu", "samples_per_s", "tokens_per_s", "step_s", "efficiency", "speedup")
PLAN_FIELDS = ("dp", "tp", "pp", "microbatches", "schedule", "virtual_stages", "scheduler", "compressor",
               "algorithm", "servers", "consistency", "sequence_parallel",
               "ps_node_sum", "ps_colocated")
WITHIN = 0.15
# What a framework's runs carry beyond the hardware, for the cases that name it (`framework:`), each value
# fitted to that framework's fit cases (`--fit tensorflow-1.op_overhead_s`) and never to a held-out one:
# - tensorflow-1: the seconds TensorFlow 1.x's executor adds per op it launches, which the GPU does not
#   hide (the TensorFlow page's one-GPU runs at batch 32 and 64 put an intercept of 36 ms a step under
#   ResNet-50 and 77 ms under ResNet-152, in proportion to their op counts).
FRAMEWORKS: dict[str, dict[str, float]] = {"tensorflow-1": {"op_overhead_s": 60e-6}}
# How a framework runs a plan, read from its source code (not fitted), for the cases that name it; a
# case's own plan fields win:
# - megatron-lm: its DistributedDataParallel (megatron/model/distributed.py, 2021-2023) only adds each
#   gradient into the contiguous `main_grad` buffer during backward; `train_step` all-reduces the whole
#   buffer (`allreduce_gradients`) once every micro-batch's backward has finished, so no reduction
#   overlaps compute (overlapping it, `--overlap-grad-reduce`, came later and is off by default): the
#   model's fifo, every bucket after backward.
# - megatron-deepspeed: DeepSpeed's pipeline engine runs the same way: its TrainSchedule issues
#   ReduceGrads after the last backward of the batch, then the optimizer step.
FRAMEWORK_PLANS: dict[str, dict[str, Any]] = {"megatron-lm": {"scheduler": "fifo"},
                                              "megatron-deepspeed": {"scheduler": "fifo"}}


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
    """The numbers of a `gpt:layers=..,hidden=..` spec (named settings such as attention=math left out)."""
    _, _, rest = spec.partition(":")
    pairs = (item.split("=") for item in rest.split(",") if "=" in item)
    return {k: int(v) for k, v in pairs if v.isdigit()}


@functools.cache
def _profile(model: str, dtype: str, recompute: str, half_model: bool = False):
    return profile_model(model, dtype=dtype, recompute=recompute, half_model=half_model)


def throughput(case: dict[str, Any], plan_raw: dict[str, Any], batch: int) -> tuple[float, Any]:
    """(samples a second, the estimate) of the case's model and hardware under `plan_raw` (over its
    framework's way of running a plan, `FRAMEWORK_PLANS`); a case's `layout` (megatron, zero1...) is
    the framework's: the model itself in its dtype, its memory layout."""
    name = case.get("framework", "")
    if name and name not in FRAMEWORKS and name not in FRAMEWORK_PLANS:
        raise UserError(f"case {case['id']!r}: framework {name!r} is not known; choose from "
                        f"{', '.join(sorted({*FRAMEWORKS, *FRAMEWORK_PLANS}))}")
    framework = FRAMEWORKS.get(name, {})
    plan_raw = {**FRAMEWORK_PLANS.get(name, {}), **plan_raw}
    raw = dict(case["hardware"])
    raw["constants"] = {**framework, **(raw.get("constants") or {})}
    hw = hardware(raw, case["id"])
    layout = case.get("layout", "ddp")
    profile = _profile(case["model"], case.get("dtype", "fp32"), case.get("recompute", "none"),
                       layout != "ddp")
    est = estimate(profile, hw, plan_of(plan_raw, case["id"]), batch,
                   Options(optimizer=case.get("optimizer", "adam"), layout=layout))
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


def device_of(case: dict[str, Any]) -> str | None:
    """The device preset a case's hardware names (itself, or a mapping's `preset:`)."""
    device = case["hardware"].get("device")
    return device if isinstance(device, str) else device.get("preset") if isinstance(device, dict) else None


def with_constant(case: dict[str, Any], name: str, value: float) -> dict[str, Any]:
    """The case with its hardware's constant `name` set to `value` (over its framework's)."""
    constants = {**(case["hardware"].get("constants") or {}), name: value}
    return {**case, "hardware": {**case["hardware"], "constants": constants}}


def _with_device_table(case: dict[str, Any], table: str, key: str, value: float) -> dict[str, Any]:
    """The case with its device's `table` (efficiency, winograd) set at `key` (the rest inherited)."""
    device = case["hardware"]["device"]
    device = dict(device) if isinstance(device, dict) else {"preset": device}
    device[table] = {**device.get(table, {}), key: value}
    return {**case, "hardware": {**case["hardware"], "device": device}}


def with_efficiency(case: dict[str, Any], op_class: str, value: float) -> dict[str, Any]:
    """The case with its device's efficiency for `op_class` set to `value` (the rest inherited)."""
    return _with_device_table(case, "efficiency", op_class, value)


def with_winograd(case: dict[str, Any], _: str, value: float) -> dict[str, Any]:
    """The case with its device's fp32 Winograd factor set to `value` (the rest inherited)."""
    return _with_device_table(case, "winograd", "fp32", value)


def _errors(cases: list[dict[str, Any]]) -> list[float]:
    return [predict(case)["predicted"] / float(case["measured"]["value"]) - 1 for case in cases]


def fit_efficiency(cases_file: Path, target: str) -> dict[str, Any]:
    """`--fit DEVICE.CLASS`: the efficiency of one op class of one device preset that fits its `fit`
    cases best (median absolute error, then mean, over a 0.01 grid in (0, 1]); `DEVICE.winograd` its
    fp32 Winograd factor (a 0.05 grid in [1, 4])."""
    device, _, op_class = target.partition(".")
    cases = yaml.safe_load(cases_file.read_text())["cases"]
    if device in FRAMEWORKS:  # a framework's constant: over its fit cases, 0 and 1-9 x 1e-6..1e-3
        chosen = [c for c in cases if c["split"] == "fit" and c.get("framework") == device]
        grid = [0.0] + [k * 10.0**e for e in range(-6, -2) for k in range(1, 10)]
        variant = with_constant
    else:
        if op_class not in (*OP_CLASSES, "winograd"):
            raise UserError(f"--fit {target!r}: write DEVICE.CLASS with a class in {', '.join(OP_CLASSES)}, "
                            "DEVICE.winograd, or FRAMEWORK.CONSTANT with a framework in "
                            f"{', '.join(FRAMEWORKS)}")
        chosen = [c for c in cases if c["split"] == "fit" and device_of(c) == device]
        grid, variant = [step / 100 for step in range(1, 101)], with_efficiency
        if op_class == "winograd":
            grid, variant = [step / 100 for step in range(100, 401, 5)], with_winograd
    if not chosen:
        raise UserError(f"--fit {target!r}: no fit case runs on {device!r}")
    scored = []
    for value in grid:
        errors = _errors([variant(c, op_class, value) for c in chosen])
        magnitudes = [abs(e) for e in errors]
        scored.append((statistics.median(magnitudes), statistics.fmean(magnitudes), value, errors))
    median, _, value, errors = min(scored)
    before = _errors(chosen)
    return {"device": device, "op_class": op_class, "value": value, "cases": [c["id"] for c in chosen],
            "errors_before": before, "errors_after": errors,
            "median_before": statistics.median(abs(e) for e in before), "median_after": median}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--cases", default=str(CASES))
    parser.add_argument("--only", nargs="*", help="these case ids alone")
    parser.add_argument("--fit", nargs="*", metavar="DEVICE.CLASS",
                        help="fit these device efficiencies to the fit cases instead of reporting")
    args = parser.parse_args(argv)
    try:
        if args.fit:
            fits = [fit_efficiency(Path(args.cases), target) for target in args.fit]
            write_json(args.json, {"cases_file": args.cases, "fits": fits})
            for fit in fits:
                print(f"{fit['device']}.{fit['op_class']} = {fit['value']:.3g}: median |error| over "
                      f"{len(fit['cases'])} fit cases {fit['median_before']:.1%} -> "
                      f"{fit['median_after']:.1%}")
                changes = zip(fit["cases"], fit["errors_before"], fit["errors_after"], strict=True)
                for case, old, new in changes:
                    print(f"  {case}: {old:+.1%} -> {new:+.1%}")
            return 0
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

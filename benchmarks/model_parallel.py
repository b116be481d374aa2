"""Model parallelism on the byte-level GPT and the stdlib text: step time, memory and bubble per plan.

    python benchmarks/model_parallel.py [--quick] --json OUT

Every paraloom row is `paraloom train --nproc N` (the elastic launcher, gloo on loopback) with
the GPT below; the peers run the same model, batch and optimizer under torchrun
(benchmarks/mp_peer.py). Parts:
  (a) 4 workers: DP, TP = 2 (dp2 x tp2) and 4, PP = 2 (dp2 x pp2) and 4 with m = 1, 2, 4, 8 under
      gpipe and 1f1b, layers (4 stages), tp2 x pp2; per-rank parameter bytes, peak held
      activation bytes, peak RSS, step time and measured bubble;
  (b) 2 workers, one core each: p = 2, m = 8, paraloom gpipe and 1f1b against torch.distributed
      .pipelining's ScheduleGPipe and Schedule1F1B (alternated, `--repeats` times, medians), and
      the bubble against theory (p-1)/(m+p-1), on the GPT above and on BUBBLE_GPT, deeper and wider,
      with stages balanced by profiled time (theory assumes equal stages and free messages: the
      small GPT's 3 | 3 split is uneven because the last stage holds the head, and per-message
      latency weighs more against its small micro-batches). On BUBBLE_GPT the headline is the
      bottleneck stage's idle share (fill and drain); the mean over stages, which adds the other
      stage's load imbalance, is reported beside it;
      TP = 2 and 4 against DTensor's parallelize_module (part c);
  (c) learning: dp2 x pp2 (1f1b, m = 4) for `LEARN_STEPS` steps; validation loss against the
      unigram baseline of the same split.
  (e) interleaving: p = 2, m = 8 on BUBBLE_GPT (stages balanced by profiled time), 1f1b against
      interleaved_1f1b with v = 2, `--repeats` runs each alternated, `BUBBLE_STEPS` steps a run; the
      pipeline's fill and drain (median over runs) against (p-1)/(m+p-1) and (p-1)/(v m+p-1), read
      on the last stage (the headline since 2026-11-29: the ideal run idles it only before its first
      action and after its last, so no mid-schedule jitter moves idle into or out of it), and the
      bottleneck stage's (the headline of runs 1-15) in all and split: the fill and drain (its idle
      where the ideal schedule has idle, `schedules.idle_before`) and its steady-state waits (where
      the ideal has none: the stages' uneven compute from one micro-batch to the next, and the
      runtime's own work). Each share is the median over a run's steps of that step's share
      (`stages.bubbles`); the reading of runs 1-14, a share of the times' medians taken apart, is
      recorded beside it (`bubble_fill_drain_of_medians`).
A step time is the median over a run's steps (the first two excluded) of the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import make_table, train, write_json
from rich.console import Console

GPT = {"seq_len": 64, "n_layers": 4, "d_model": 128, "n_heads": 4, "batch_size": 32}
STEPS = 14
LEARN_STEPS = 300
BUBBLE_GPT = {"seq_len": 64, "n_layers": 8, "d_model": 256, "n_heads": 8, "batch_size": 64}
BUBBLE_STEPS = 30  # part (e): a steadier median step than STEPS gives
ROOT = Path(__file__).resolve().parent


def gpt_args(gpt: dict[str, int]) -> list[str]:
    return ["--set", "model.name=gpt", "--set", "data.name=text",
            "--set", f"data.seq_len={gpt['seq_len']}", "--set", f"model.n_layers={gpt['n_layers']}",
            "--set", f"model.d_model={gpt['d_model']}", "--set", f"model.n_heads={gpt['n_heads']}",
            "--set", f"data.batch_size={gpt['batch_size']}"]


def paraloom(out: Path, name: str, nproc: int, gpt: dict[str, int], steps: int, *sets: str) -> dict[str, Any]:
    """One `paraloom train` run of the GPT on `nproc` workers; returns its summary."""
    return train(out, name, ["--nproc", str(nproc), *gpt_args(gpt)], sets=[f"optim.max_steps={steps}", *sets],
                 timeout=1200)


def peer(out: Path, name: str, nproc: int, gpt: dict[str, int], steps: int, *args: str) -> dict[str, Any]:
    """One run of a torch peer under torchrun; returns its report."""
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "mp_peer.py"), "--seq-len", str(gpt["seq_len"]), "--n-layers", str(gpt["n_layers"]),
           "--d-model", str(gpt["d_model"]), "--n-heads", str(gpt["n_heads"]),
           "--batch-size", str(gpt["batch_size"]), "--steps", str(steps), "--json", str(path), *args]
    path.unlink(missing_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if path.is_file():  # written before teardown; torch's 1F1B sometimes aborts while exiting
        report = json.loads(path.read_text())
        if done.returncode:
            report["exit"] = f"exit code {done.returncode} after the figures were written"
        return report
    lines = [line for line in done.stderr.splitlines()
             if ("Error" in line or "terminate" in line) and "error_file" not in line]
    return {"error": (lines[-1] if lines else done.stderr[-500:]).strip()}


def full_param_bytes(gpt: dict[str, int]) -> int:
    """Parameter bytes of the whole GPT (what a data-parallel rank holds), counted on the meta device."""
    import torch

    from paraloom.models.gpt import GPT

    with torch.device("meta"):
        model = GPT((gpt["seq_len"],), 256, n_layers=gpt["n_layers"], d_model=gpt["d_model"],
                    n_heads=gpt["n_heads"])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def row(summary: dict[str, Any], gpt: dict[str, int]) -> dict[str, Any]:
    """The figures a plan's run contributes to the report.

    A data-parallel run (paraloom's data-parallel trainer) reports its mean step time over all
    steps and holds the whole model on every rank; it measures no bubble or held activations.
    """
    if "grid" not in summary:
        world = summary["world_size"]
        return {"grid": {"dp": world, "tp": 1, "pp": 1}, "schedule": None, "microbatches": 1,
                "partition": None, "step_seconds": summary["train_seconds"] / summary["steps"],
                "step_seconds_per_rank": None, "bubble": None, "bubble_per_rank": [], "bubble_theory": 0.0,
                "param_bytes_per_rank": [full_param_bytes(gpt)] * world,
                "activation_peak_bytes_per_rank": [], "rss_peak_mb_per_rank": [],
                "final_loss": summary["final_loss"], "val_loss": None,
                "samples_per_second": summary["samples_per_second"]}
    return {key: summary[key] for key in (
        "grid", "schedule", "microbatches", "partition", "step_seconds", "step_seconds_per_rank", "bubble",
        "bubble_per_rank", "bubble_theory", "param_bytes_per_rank", "activation_peak_bytes_per_rank",
        "rss_peak_mb_per_rank", "final_loss", "val_loss", "samples_per_second")}


def plans(quick: bool) -> dict[str, tuple[str, ...]]:
    """Name -> config overrides of every 4-worker plan of part (a)."""
    if quick:
        return {"tp4": ("parallel.tp=4",)}
    out: dict[str, tuple[str, ...]] = {"dp4": (), "dp2_tp2": ("parallel.tp=2",), "tp4": ("parallel.tp=4",)}
    for pp in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4, 8):
                name = f"{'dp2_' if pp == 2 else ''}pp{pp}_{schedule}_m{m}"
                out[name] = (f"parallel.pp={pp}", f"parallel.schedule={schedule}",
                             f"parallel.microbatches={m}")
    out["layers4"] = ("parallel.mode=layers",)
    out["tp2_pp2_1f1b_m4"] = ("parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b",
                              "parallel.microbatches=4")
    return out


def pipeline_versus_torch(out: Path, gpt: dict[str, int], steps: int, m: int, repeats: int,
                          schedules: tuple[str, ...] = ("gpipe", "1f1b"),
                          bubble_gpt: dict[str, int] | None = None) -> dict[str, Any]:
    """Part (b): p = 2 on 2 workers, paraloom and torch.distributed.pipelining alternated."""
    result: dict[str, Any] = {}
    for schedule in schedules:
        ours, theirs, bubbles, runs = [], [], [], []
        for i in range(repeats):
            summary = paraloom(out, f"p2_{schedule}_{i}", 2, gpt, steps, "parallel.pp=2",
                               f"parallel.schedule={schedule}", f"parallel.microbatches={m}")
            ours.append(summary["step_seconds"])
            bubbles.append(summary["bubble"])
            runs.append(row(summary, gpt))
            report = peer(out, f"torch_p2_{schedule}_{i}", 2, gpt, steps, "--kind", "pipelining",
                          "--schedule", schedule, "--microbatches", str(m))
            if "error" in report:
                result[schedule] = {"torch_error": report["error"], "paraloom_runs": runs}
                break
            theirs.append(report["step_seconds"])
        else:
            theory = runs[0]["bubble_theory"]
            bubble = statistics.median(bubbles)
            result[schedule] = {
                "paraloom_step_s": statistics.median(ours), "torch_step_s": statistics.median(theirs),
                "ratio": statistics.median(ours) / statistics.median(theirs),
                "paraloom_step_s_all": ours, "torch_step_s_all": theirs,
                "bubble_measured": bubble, "bubble_theory": theory,
                "bubble_rel_error": abs(bubble - theory) / theory, "paraloom_runs": runs}
        if bubble_gpt:
            big = paraloom(out, f"p2_{schedule}_bubble", 2, bubble_gpt, steps, "parallel.pp=2",
                           f"parallel.schedule={schedule}", f"parallel.microbatches={m}",
                           "parallel.balance=time")
            theory = big["bubble_theory"]
            result.setdefault(schedule, {})["bubble_model"] = {
                "gpt": bubble_gpt, "balance": "time", "partition": big["partition"],
                "bubble_measured": big["bubble_bottleneck"], "bubble_theory": theory,
                "bubble_rel_error": abs(big["bubble_bottleneck"] - theory) / theory,
                "bubble_mean_over_stages": big["bubble"],
                "bubble_mean_rel_error": abs(big["bubble"] - theory) / theory,
                "bubble_fill_drain": big["bubble_fill_drain"],
                "bubble_fill_drain_rel_error": abs(big["bubble_fill_drain"] - theory) / theory,
                "steady_wait": big["steady_wait_bottleneck"],
                "bubble_per_rank": big["bubble_per_rank"], "step_seconds": big["step_seconds"]}
    return result


def interleaving(out: Path, gpt: dict[str, int], steps: int, m: int, v: int, repeats: int) -> dict[str, Any]:
    """Part (e): the bottleneck stage's bubble of 1f1b and interleaved_1f1b (v chunks) at p = 2."""
    runs: dict[str, list[dict[str, Any]]] = {"1f1b": [], "interleaved_1f1b": []}
    for i in range(repeats):
        for schedule in runs:
            chunks = [f"parallel.virtual_stages={v}"] if schedule == "interleaved_1f1b" else []
            summary = paraloom(out, f"e_{schedule}_{i}", 2, gpt, steps, "parallel.pp=2",
                               f"parallel.microbatches={m}", f"parallel.schedule={schedule}",
                               "parallel.balance=time", *chunks)
            kept = ("bubble_bottleneck", "bubble_fill_drain", "steady_wait_bottleneck", "bubble",
                    "bubble_theory", "step_seconds", "partition", "bubble_fill_drain_per_rank",
                    "bubble_fill_drain_of_medians", "bubble_fill_drain_last_stage")
            runs[schedule].append({**{key: summary[key] for key in kept},
                                   **at_measured_balance(summary, schedule, m, v)})
    result: dict[str, Any] = {"gpt": gpt, "p": 2, "m": m, "v": v, "steps": steps}
    for schedule, rows in runs.items():
        measured = statistics.median(r["bubble_bottleneck"] for r in rows)
        fill_drain = statistics.median(r["bubble_fill_drain"] for r in rows)
        lighter = statistics.median(r["fill_drain_lighter_stage"] for r in rows)
        expected = statistics.median(r["fill_drain_expected_bottleneck"] for r in rows)
        theory = rows[0]["bubble_theory"]
        last = statistics.median(r["bubble_fill_drain_last_stage"] for r in rows)
        # the bottleneck stage's idle share in all, and split: the fill and drain the theory describes,
        # and its waits where the ideal schedule has none (neighbours' uneven compute); the lighter
        # stage's fill and drain, which the stages' imbalance barely moves; and the bottleneck's fill
        # and drain in the ideal run of stages as unequal as the run measured them
        result[schedule] = {"bubble_measured": measured, "bubble_theory": theory,
                            "bubble_rel_error": abs(measured - theory) / theory,
                            "bubble_fill_drain": fill_drain,
                            "bubble_fill_drain_rel_error": abs(fill_drain - theory) / theory,
                            # the last stage's (idle only at its ends in the ideal run): the headline
                            "bubble_fill_drain_last_stage": last,
                            "bubble_fill_drain_last_stage_signed_error": (last - theory) / theory,
                            "bubble_fill_drain_last_stage_rel_error": abs(last - theory) / theory,
                            # read from each time's median apart (the reading of runs 1-14)
                            "bubble_fill_drain_of_medians": statistics.median(
                                r["bubble_fill_drain_of_medians"] for r in rows),
                            "fill_drain_lighter_stage": lighter,
                            "fill_drain_lighter_stage_rel_error": abs(lighter - theory) / theory,
                            "fill_drain_expected_bottleneck": expected,
                            "fill_drain_rel_error_at_measured_balance": abs(fill_drain - expected) / expected,
                            "busier_over_lighter": statistics.median(r["busier_over_lighter"] for r in rows),
                            "steady_wait": statistics.median(r["steady_wait_bottleneck"] for r in rows),
                            "step_seconds": statistics.median(r["step_seconds"] for r in rows), "runs": rows}
    result["step_ratio_interleaved_over_1f1b"] = (result["interleaved_1f1b"]["step_seconds"]
                                                  / result["1f1b"]["step_seconds"])
    return result


def at_measured_balance(summary: dict[str, Any], schedule: str, m: int, v: int) -> dict[str, float]:
    """A p = 2 run's stages as unequal as it measured them: the busier stage's compute over the
    lighter's, the lighter stage's fill and drain, and the bottleneck's fill and drain in the ideal
    run of stages that unequal (`schedules.fill_drain_shares`)."""
    from paraloom.pipeline_parallel.schedules import fill_drain_shares, make_schedule

    busy = [(1 - b) * s for b, s in zip(summary["bubble_per_rank"], summary["schedule_seconds_per_rank"],
                                        strict=True)]
    mean = sum(busy) / len(busy)
    chunks = v if schedule == "interleaved_1f1b" else 1
    ideal = fill_drain_shares(make_schedule(schedule, len(busy), m, chunks), [b / mean for b in busy])
    neck, light = max(range(len(busy)), key=busy.__getitem__), min(range(len(busy)), key=busy.__getitem__)
    return {"busier_over_lighter": busy[neck] / busy[light],
            "fill_drain_lighter_stage": summary["bubble_fill_drain_per_rank"][light],
            "fill_drain_expected_bottleneck": ideal[neck]}


def tensor_versus_dtensor(out: Path, gpt: dict[str, int], steps: int, tp: int) -> dict[str, Any]:
    ours = paraloom(out, f"tp{tp}_alone", tp, gpt, steps, f"parallel.tp={tp}")
    report = peer(out, f"dtensor_tp{tp}", tp, gpt, steps, "--kind", "dtensor")
    if "error" in report:
        return {"paraloom_step_s": ours["step_seconds"], "dtensor_error": report["error"]}
    return {"paraloom_step_s": ours["step_seconds"], "dtensor_step_s": report["step_seconds"],
            "ratio": ours["step_seconds"] / report["step_seconds"],
            "paraloom_param_bytes_per_rank": ours["param_bytes_per_rank"],
            "dtensor_param_bytes_per_rank": report["param_bytes_per_rank"]}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the report's rows (a data-parallel rank holds the whole model)."""
    rows, pipe = report.get("plans", {}), report.get("pipeline_vs_torch", {})
    summary: dict[str, Any] = {
        "tp4_param_mem_ratio": (max(rows["tp4"]["param_bytes_per_rank"]) / full_param_bytes(report["gpt"])
                                if "tp4" in rows else None),
        "bubble_rel_error": None,  # the headline: 1f1b on the bubble model where there is one
        "pp_vs_torch_pipelining": max((v["ratio"] for v in pipe.values() if "ratio" in v), default=None),
        "pp_vs_torch_pipelining_by_schedule": {k: v.get("ratio") for k, v in pipe.items()},
    }
    by_run = {}
    for schedule, result in pipe.items():
        by_run[schedule] = result.get("bubble_rel_error")
        bubble = result.get("bubble_model")
        if bubble:
            by_run[f"{schedule}_bubble_model"] = bubble["bubble_rel_error"]
    summary["bubble_rel_error_by_run"] = by_run
    onef = pipe.get("1f1b", {})
    summary["bubble_rel_error"] = onef.get("bubble_model", onef).get("bubble_rel_error")
    gpipe8, onef8 = rows.get("pp4_gpipe_m8"), rows.get("pp4_1f1b_m8")
    if gpipe8 and onef8:
        summary["p4_m8_activation_1f1b_over_gpipe_stage0"] = (
            onef8["activation_peak_bytes_per_rank"][0] / gpipe8["activation_peak_bytes_per_rank"][0])
    p2 = pipe.get("1f1b", {}).get("paraloom_runs")
    g2 = pipe.get("gpipe", {}).get("paraloom_runs")
    if p2 and g2:
        summary["p2_m8_activation_1f1b_over_gpipe_stage0"] = (
            p2[0]["activation_peak_bytes_per_rank"][0] / g2[0]["activation_peak_bytes_per_rank"][0])
    inter = report.get("interleaving")
    if inter:
        summary["bubble_rel_error_1f1b_p2_m8"] = inter["1f1b"]["bubble_rel_error"]
        summary["bubble_rel_error_interleaved_p2_m8_v2"] = inter["interleaved_1f1b"]["bubble_rel_error"]
        summary["fill_drain_rel_error_1f1b_p2_m8"] = inter["1f1b"]["bubble_fill_drain_rel_error"]
        summary["fill_drain_rel_error_interleaved_p2_m8_v2"] = (
            inter["interleaved_1f1b"]["bubble_fill_drain_rel_error"])
        summary["step_ratio_interleaved_over_1f1b"] = inter["step_ratio_interleaved_over_1f1b"]
        for key, name in (("1f1b", "1f1b_p2_m8"), ("interleaved_1f1b", "interleaved_p2_m8_v2")):
            figures = inter[key]
            summary[f"last_stage_fill_drain_rel_error_{name}"] = (
                figures["bubble_fill_drain_last_stage_rel_error"])
            summary[f"fill_drain_lighter_stage_rel_error_{name}"] = (
                figures["fill_drain_lighter_stage_rel_error"])
            summary[f"fill_drain_rel_error_at_measured_balance_{name}"] = (
                figures["fill_drain_rel_error_at_measured_balance"])
    learn = report.get("learning")
    if learn:
        summary["val_loss"] = learn["val_loss"]
        summary["unigram_loss"] = learn["unigram_loss"]
        summary["learns"] = learn["val_loss"] < learn["unigram_loss"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tp4, p = 2 1f1b and tp2 against the peers, "
                        "short runs, no learning run: a smoke run")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of paraloom and torch in (b)")
    parser.add_argument("--parts", default="abcde", help="which parts to run (a plans, b pipelines against "
                        "torch, c tensor parallelism against DTensor, d learning, e interleaving); "
                        "default all")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if not set(args.parts) <= set("abcde"):
        raise SystemExit(f"--parts {args.parts!r}: choose letters from abcde")
    gpt = dict(GPT)
    steps, learn_steps, repeats, m = STEPS, LEARN_STEPS, args.repeats, 8
    if args.quick:
        gpt.update(d_model=32, seq_len=16, batch_size=16)
        steps, learn_steps, repeats, m = 4, 20, 1, 4
    console = Console(width=150)
    report: dict[str, Any] = {"gpt": gpt, "steps": steps, "plans": {}}
    with tempfile.TemporaryDirectory(prefix="paraloom-mpbench-") as tmp:
        out = Path(tmp)
        for name, sets in (plans(args.quick) if "a" in args.parts else {}).items():
            report["plans"][name] = row(paraloom(out, name, 4, gpt, steps, *sets), gpt)
        table = make_table(f"4 workers, GPT {gpt}", ("plan", "step ms", "bubble/rank", "theory",
                                                     "param MB/rank", "held act MB/rank", "RSS MB"))
        for name, r in report["plans"].items():
            table.add_row(name, f"{r['step_seconds'] * 1e3:.1f}",
                          " ".join(f"{b:.2f}" for b in r["bubble_per_rank"]), f"{r['bubble_theory']:.2f}",
                          " ".join(f"{b / 2**20:.2f}" for b in r["param_bytes_per_rank"]),
                          " ".join(f"{b / 2**20:.1f}" for b in r["activation_peak_bytes_per_rank"]),
                          f"{max(r['rss_peak_mb_per_rank'], default=0):.0f}")
        if report["plans"]:
            console.print(table)
        if "b" in args.parts:
            schedules = ("1f1b",) if args.quick else ("gpipe", "1f1b")
            report["pipeline_vs_torch"] = pipeline_versus_torch(out, gpt, steps, m, repeats, schedules,
                                                                None if args.quick else BUBBLE_GPT)
        if "c" in args.parts:
            report["tensor_vs_dtensor"] = {f"tp{tp}": tensor_versus_dtensor(out, gpt, steps, tp)
                                           for tp in ((2,) if args.quick else (2, 4))}
        if "d" in args.parts and not args.quick:
            learn = paraloom(out, "learn", 4, gpt, learn_steps, "parallel.pp=2", "parallel.schedule=1f1b",
                             "parallel.microbatches=4", f"run.log_every={max(1, learn_steps // 10)}")
            report["learning"] = {"steps": learn_steps, "val_loss": learn["val_loss"],
                                  "unigram_loss": learn["unigram_loss"], "accuracy": learn["test_accuracy"],
                                  "train_seconds": learn["train_seconds"]}
        if "e" in args.parts:
            bubble_gpt = dict(gpt, n_layers=4) if args.quick else BUBBLE_GPT
            report["interleaving"] = interleaving(out, bubble_gpt, steps if args.quick else BUBBLE_STEPS,
                                                  m, 2, repeats)
    report["summary"] = summarize(report)
    shown = {k: {kk: vv for kk, vv in v.items() if kk != "paraloom_runs"}
             for k, v in report.get("pipeline_vs_torch", {}).items()}
    inter = {k: ({kk: vv for kk, vv in v.items() if kk != "runs"} if isinstance(v, dict) else v)
             for k, v in report.get("interleaving", {}).items()}
    console.print_json(data={"pipeline_vs_torch": shown, "tensor_vs_dtensor": report.get("tensor_vs_dtensor"),
                             "interleaving": inter, "summary": report["summary"]})
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

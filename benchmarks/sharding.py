"""Fully sharded data parallelism (parallel.shard) against torch's fully_shard and DDP, same run.

    python benchmarks/sharding.py [--quick] [--repeats 5] [--no-emulate] [--speed-only] [--explain]
                                  [--model-only] --json OUT

Memory: 4 workers on loopback train the zoo's GPT at width 1024, 8 layers (101M parameters), AdamW; per
rank, the bytes of parameters, gradients and optimizer state held after a step, for DDP, a bare
`fully_shard` loop and paraloom at `gradients` and `full` (blocks, and FINE_UNITS), and the most of
those plus their gather and reduction buffers alive at once during a step (read after every operator),
set beside the performance model's (`memory_model`). Speed: 4 workers, the GPT at width 256, 4 layers,
batch 8 x 64 tokens per worker, on loopback and on an emulated 4 x 1 Gbit/s cluster (needs root): DDP,
bare `fully_shard` and paraloom `full` take turns (paraloom.bench.sharding); a ratio is the median over
rounds of paraloom's step over the peer's.

The model on sharded plans (`step_model`; emulated clusters, needs root; skipped by `--quick`
unless `--model-only`): at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s, perfmodel_validation.py's
calibration (links at 2 and 4 nodes, the refinement's loopback runs) plus the sharded machinery's
host cost (a one-rank `full` run against a plain one), then the validation's GPT at `gradients`,
`full`, `hybrid` (groups of 2) and `full` accumulating 2 micro-batches into the shards, at 2 and 4
workers, and `full` x tp2 on 4, with the unsharded runs as references for the best plan of each
group: every configuration is predicted, and the predictions written to the report, before the
first of them is measured; 1 and 10 Gbit/s run twice, interleaved. Configurations measured before
the model's last change are marked `seen`.

Summary (`summary` in the JSON): `mem_ratio_full_vs_ddp`, `mem_ratio_gradients_vs_ddp` and
`mem_ratio_vs_fully_shard` (the peaks, by torch's memory tracker), `mem_ratio_full_at_rest_vs_ddp`
(after a step), `mem_ratio_full_units_vs_ddp` (`full` at `parallel.shard_units=FINE_UNITS`),
`model_memory_max_abs_err`,
`step_ratio_vs_fully_shard_loopback`, `step_ratio_vs_fully_shard_1gbit`, `step_ratio_vs_ddp_loopback`,
`step_ratio_vs_ddp_1gbit`; `model_median_abs_err`, `model_max_abs_err` and `n_model_configs` over the
sharded configurations of `step_model` (null and 0 without it), `model_best_plan_hits`.
`--explain` adds the bare loop clipping as paraloom does and paraloom without explicit prefetch
(paraloom.bench.sharding), to tell where a difference between paraloom and the bare loop comes
from; `--speed-only` skips the memory part; `--model-only` runs the model's part alone and adds it to
the report already at `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from clusters import emulated
from common import make_table, write_json
from rich.console import Console

from paraloom.bench.harness import launch

BIG = {"vocab": 256, "seq": 64, "layers": 8, "width": 1024, "heads": 16}
SMALL = {"vocab": 256, "seq": 64, "layers": 4, "width": 256, "heads": 4}
TINY = {"vocab": 256, "seq": 16, "layers": 2, "width": 32, "heads": 2}


# the held runs' parallel.shard_units for "paraloom_full_units": each block's attention and feed-forward
# apart, so the largest unit is 2/3 of a block (chosen after the blocks' 0.330 of DDP's peak was measured)
FINE_UNITS = "Attention,FeedForward"
# the held variants as the model's plans: (shard level, parallel.shard_prefetch); the bare loop gets
# torch's implicit prefetch only, as paraloom at shard_prefetch=0
HELD_PLANS = {"ddp": ("none", 1), "fully_shard": ("full", 0), "paraloom_gradients": ("gradients", 1),
              "paraloom_full": ("full", 1), "paraloom_full_no_prefetch": ("full", 0),
              "paraloom_full_pp2": ("full", 1),  # dp2 x pp2, one micro-batch: stage 0, kept gathered
              "paraloom_full_units": ("full", 1)}  # at FINE_UNITS


def memory_model(held: dict[str, Any], shape: dict[str, int], batch: int) -> dict[str, Any]:
    """The model's bytes of parameters, gradients and optimizer state per rank at the step's peak
    (perfmodel/cost/sharding.py; memory.stage_memory's weights, grads and optimizer: the engine's
    bucket is paraloom's, not DDP's, and activations are not measured here) against `held`'s peaks."""
    from paraloom.perfmodel.cost.memory import stage_memory
    from paraloom.perfmodel.measure.profile import profile_model, shard_unit_sizes
    from paraloom.perfmodel.plan import Options, Plan

    world = 4
    spec = (f"gpt:layers={shape['layers']},hidden={shape['width']},heads={shape['heads']},seq={shape['seq']},"
            f"vocab={shape['vocab']}")
    profile = profile_model(spec)
    out = {}
    for name, (level, prefetch) in HELD_PLANS.items():
        if name not in held:
            continue
        part, plan, group = profile, Plan(dp=world, shard=level), world
        if name.endswith("_pp2"):  # rank 0's stage (the layers its parameters add up to), over 2 ranks
            stop = next(k for k in range(1, len(profile.layers) + 1)
                        if profile.slice(0, k).n_params >= held[name]["n_params"])
            part, plan, group = profile.slice(0, stop), Plan(dp=2, pp=2, shard=level), 2
        units = shard_unit_sizes(spec, FINE_UNITS if name.endswith("_units") else "auto")
        kinds = stage_memory(part, plan, 0, batch, Options(optimizer="adam", shard_prefetch=prefetch,
                                                           shard_units=units), shard_size=group)
        predicted = kinds["weights"] + kinds["grads"] + kinds["optimizer"]
        out[name] = {"predicted": predicted, "measured": held[name]["peak_state"],
                     "rel_err": predicted / held[name]["peak_state"] - 1}
    return out


# ---- the performance model's step time on sharded plans, emulated clusters (needs root)

# the validation's GPT (benchmarks/perfmodel_validation.py), its levels at 2 and 4 workers per link rate;
# the unsharded runs are references for the best plan found in each group, not counted in the errors
STEP_CONFIGS = {
    "none dp2": (2, []), "gradients dp2": (2, ["parallel.shard=gradients"]),
    "full dp2": (2, ["parallel.shard=full"]), "none dp4": (4, []),
    "gradients dp4": (4, ["parallel.shard=gradients"]), "full dp4": (4, ["parallel.shard=full"]),
    "hybrid2 dp4": (4, ["parallel.shard=hybrid", "parallel.shard_group=2"]),
    "full dp4 m2 sum-sharded": (4, ["parallel.shard=full", "optim.accumulate=2",
                                    "parallel.shard_accumulate=sharded"]),
    # 2-D, added for run 2: tp pairs, two data-parallel copies of them
    "none dp2 tp2": (4, ["parallel.tp=2"]), "full dp2 tp2": (4, ["parallel.shard=full", "parallel.tp=2"]),
    # 3-D, added after run 2: two pipeline stages, each sharded over 2 data-parallel ranks
    "none dp2 pp2": (4, ["parallel.pp=2", "parallel.microbatches=4"]),
    "full dp2 pp2": (4, ["parallel.shard=full", "parallel.pp=2", "parallel.microbatches=4"]),
    # added with the arrival term (run 3), measured only after it: held out
    "full dp2 m2": (2, ["parallel.shard=full", "optim.accumulate=2"]),
    "gradients dp2 tp2": (4, ["parallel.shard=gradients", "parallel.tp=2"]),
    "hybrid2 dp4 m2": (4, ["parallel.shard=hybrid", "parallel.shard_group=2", "optim.accumulate=2"]),
    "full dp4 kept": (4, ["parallel.shard=full", "parallel.reshard_after_forward=false"]),
    # added with the units the run cuts its model in (Options.shard_units) and the stage roots counted as
    # units, measured only after them: held out (run 4)
    "full dp4 fine": (4, ["parallel.shard=full", f"parallel.shard_units={FINE_UNITS}"]),
    "gradients dp4 m2": (4, ["parallel.shard=gradients", "optim.accumulate=2"]),
    "hybrid2 dp4 kept": (4, ["parallel.shard=hybrid", "parallel.shard_group=2",
                             "parallel.reshard_after_forward=false"]),
    "full dp2 tp2 m2": (4, ["parallel.shard=full", "parallel.tp=2", "optim.accumulate=2"]),
}
STEP_RATES = ("100mbit", "1gbit", "10gbit")  # 10 Gbit/s added for run 2
STEP_STEPS = {"100mbit": 30, "1gbit": 60, "10gbit": 120}  # a 100 Mbit/s full dp4 step: ~1 s
STEP_PASSES = {"100mbit": 1, "1gbit": 2, "10gbit": 2}
# measured before the model's gloo terms were chosen (cost/sharding.py, `gloo`): the quick run's full
# dp2 at 1 Gbit/s, then run 1's eight configurations at 100 Mbit/s and 1 Gbit/s; not held out, so the
# summary gives the errors with and without them
RUN_1 = ("none dp2", "gradients dp2", "full dp2", "none dp4", "gradients dp4", "full dp4", "hybrid2 dp4",
         "full dp4 m2 sum-sharded")
# measured before the arrival term (cost/cpu.py `arrival_seconds`) was added: run 2's configurations at every
# rate, and the sharded pipeline's first at 1 Gbit/s
RUN_2 = (*RUN_1, "none dp2 tp2", "full dp2 tp2")
SEEN = (*(f"{name} {rate}" for name in RUN_1 for rate in ("100mbit", "1gbit")),
        *(f"{name} {rate}" for name in RUN_2 for rate in STEP_RATES),
        "none dp2 pp2 1gbit", "full dp2 pp2 1gbit",
        # run 3's, measured before the units were the run's (Options.shard_units)
        *(f"{name} {rate}" for name in ("full dp2 m2", "gradients dp2 tp2", "hybrid2 dp4 m2", "full dp4 kept",
                                        "full dp2 pp2") for rate in ("1gbit", "10gbit")))
ARRIVAL_RANKS, ARRIVAL_SEGMENTS_MS = (2, 4), (1.0, 4.0, 16.0)  # collective_arrival.py's, before the rates


def _sharded_host_rate(out, rate: str, plain_run, console) -> tuple[float, dict[str, float]]:
    """The fully sharded machinery's host seconds per byte gathered or reduced (cost/sharding.py's
    HOST_RATE): a one-rank `full` run of the GPT against the refinement's plain one-rank run (the
    same model, batch and thread), over the bytes its units pass a step (two gathers and one reduction
    of the whole model in fp32). Neither run is a validated configuration."""
    import perfmodel_validation as pv

    from paraloom.perfmodel.measure.profile import profile_model
    from paraloom.perfmodel.runs.finished import measured_step_seconds

    console.print(f"calibrating: the sharded machinery's host cost at {rate} (1 rank, full against none)")
    one_thread = dict(os.environ, OMP_NUM_THREADS="1")
    run = pv.train(out, f"refine shard {rate}", [*pv.GPT, "parallel.shard=full"], ["--nproc", "1"],
                   one_thread, pv.REFINE_STEPS)
    full, plain = measured_step_seconds(run), measured_step_seconds(plain_run)
    params = profile_model("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=256").n_params
    passed = params * 4.0 * 3
    return max(0.0, full - plain) / passed, {"full_s": full, "plain_s": plain, "bytes": passed}


def step_model(quick: bool, console, save, rates: list[str] | None = None,
               names: list[str] | None = None, passes: int | None = None) -> dict[str, Any]:
    """Calibrate per link rate (perfmodel_validation's links, refinement and the machinery's host rate),
    predict every configuration and write the predictions down, then measure them in interleaved passes."""
    import tempfile
    from pathlib import Path

    import collective_arrival
    import perfmodel_validation as pv

    from paraloom.cli.options import link_timers
    from paraloom.cluster import parse_rate
    from paraloom.config import load_config
    from paraloom.perfmodel.cost.sharding import HOST_RATE
    from paraloom.perfmodel.cost.step_time import estimate
    from paraloom.perfmodel.from_config import predictable
    from paraloom.perfmodel.measure.calibrate import calibrate
    from paraloom.perfmodel.measure.profile import profile_model, with_units
    from paraloom.perfmodel.runs.finished import measured_step_seconds
    from paraloom.perfmodel.runs.refine import refine

    rates = rates or (STEP_RATES[1:] if quick else STEP_RATES)
    names = names or (["none dp2", "full dp2"] if quick else list(STEP_CONFIGS))
    from paraloom.perfmodel.cost.cpu import arrival_key

    report: dict[str, Any] = {"hardware": {}, "configs": []}
    console.print("measuring: a blocking collective's cost between compute segments (collective_arrival.py)")
    plans = [(ms, collective_arrival._matmuls_for(ms)) for ms in ARRIVAL_SEGMENTS_MS]
    arrival = {n: collective_arrival.measure(n, plans, 1 if quick else 5) for n in ARRIVAL_RANKS}
    report["arrival"] = arrival
    with tempfile.TemporaryDirectory(prefix="paraloom-shard-model-") as tmp:
        out = Path(tmp)
        for rate in rates:
            console.print(f"calibrating: compute and links at {rate}")
            with contextlib.ExitStack() as stack:
                cluster = stack.enter_context(emulated(2, parse_rate(rate), "shm"))
                groups = [stack.enter_context(emulated(4, parse_rate(rate), "shm"))]
                hw, _ = calibrate(timers=link_timers(), cluster=cluster, group_clusters=groups,
                                  name=f"this-machine-{rate}")
            runs = pv.loopback_refinement(out, rate, console)
            hw, points = refine(hw, runs)
            host_rate, host_runs = _sharded_host_rate(out, rate, runs[-1], console)
            hw.constants[HOST_RATE] = host_rate
            for n, rows in arrival.items():
                for row in rows:
                    hw.constants[arrival_key(n, row["segment_ms"])] = max(0.0, row["penalty_ms"]) / 1e3
            hardware = out / f"hardware-{rate}.yaml"
            hardware.write_text(hw.to_yaml())
            report["hardware"][rate] = {"profile": hw.to_dict(), "refined_from": points,
                                        "host_rate": host_runs}
            rows = []
            for name in names:  # predicted and written down before any of them is measured
                workers, settings = STEP_CONFIGS[name]
                cfg = load_config(None, [*pv.GPT, *settings])
                what = with_units(predictable(cfg, workers))
                e = estimate(profile_model(what.spec, recompute=what.recompute), hw, what.plan,
                             what.global_batch, what.options)
                group = next((f"dp2 {axis} {rate}" for axis in ("tp2", "pp2") if axis in name),
                             f"dp{workers} {rate}")
                rows.append({"name": f"{name} {rate}", "group": group, "workers": workers,
                             "rate": rate, "settings": settings, "plan": what.plan.label(),
                             "sharded": cfg.parallel.shard != "none", "seen": f"{name} {rate}" in SEEN,
                             "predicted_s": e.step_s,
                             "breakdown": e.breakdown, "measured_passes": []})
            report["configs"] += rows
            save(report)
            for p in range(1 if quick else passes or STEP_PASSES[rate]):
                for row in rows:
                    predicted = row["predicted_s"] * 1e3
                    console.print(f"{row['name']} (pass {p + 1}): predicted {predicted:.1f} ms")
                    run = pv.train(out, f"{row['name']} {p}", [*pv.GPT, *row["settings"]],
                                   ["--emulate", f"{row['workers']}x{rate}"],
                                   steps=10 if quick else STEP_STEPS[rate], hardware=str(hardware))
                    row["measured_passes"].append(measured_step_seconds(run))
                    save(report)
            for row in rows:
                row["measured_s"] = statistics.median(row["measured_passes"])
                row["rel_err"] = row["predicted_s"] / row["measured_s"] - 1
    groups = {}
    for group in dict.fromkeys(r["group"] for r in report["configs"]):
        rows = [r for r in report["configs"] if r["group"] == group]
        pick, fastest = min(rows, key=lambda r: r["predicted_s"]), min(rows, key=lambda r: r["measured_s"])
        groups[group] = {"predicted_fastest": pick["name"], "measured_fastest": fastest["name"],
                         "hit": pick["measured_s"] <= 1.05 * fastest["measured_s"]}
    report["groups"] = groups
    errors = [abs(r["rel_err"]) for r in report["configs"] if r["sharded"]]
    unseen = [abs(r["rel_err"]) for r in report["configs"] if r["sharded"] and not r["seen"]]
    report["summary"] = {"median_abs_err": statistics.median(errors) if errors else None,
                         "max_abs_err": max(errors) if errors else None, "n_configs": len(errors),
                         "unseen_median_abs_err": statistics.median(unseen) if unseen else None,
                         "unseen_max_abs_err": max(unseen) if unseen else None,
                         "best_plan_hits": sum(g["hit"] for g in groups.values()), "groups": len(groups)}
    save(report)
    return report


def summarize(held: dict[str, Any], speed: dict[str, Any], memory: dict[str, Any] | None,
              steps: dict[str, Any] | None) -> dict[str, Any]:
    def peak(name: str) -> float:  # the most state alive at once during a step, buffers included
        return held[name]["peak_state"]

    ddp = held["ddp"]["total"]
    out: dict[str, Any] = {
        "mem_ratio_full_vs_ddp": peak("paraloom_full") / peak("ddp"),
        "mem_ratio_full_at_rest_vs_ddp": held["paraloom_full"]["total"] / ddp,
        "mem_ratio_gradients_vs_ddp": peak("paraloom_gradients") / peak("ddp"),
        "mem_ratio_vs_fully_shard": peak("paraloom_full") / peak("fully_shard"),
        # parallel.shard_prefetch=0: torch's implicit prefetch only, as the bare loop
        "mem_ratio_no_prefetch_vs_fully_shard": peak("paraloom_full_no_prefetch") / peak("fully_shard"),
    }
    if "paraloom_full_units" in held:  # parallel.shard_units=FINE_UNITS
        out["mem_ratio_full_units_vs_ddp"] = peak("paraloom_full_units") / peak("ddp")
        out["full_units"] = FINE_UNITS
    for name, cluster in (("loopback", "loopback_4"), ("1gbit", "emulated_4x1gbit")):
        if cluster in speed:
            out[f"step_ratio_vs_fully_shard_{name}"] = speed[cluster]["ratio_vs_fully_shard"]
            out[f"step_ratio_vs_ddp_{name}"] = speed[cluster]["ratio_vs_ddp"]
    if memory:
        out["model_memory_max_abs_err"] = max(abs(row["rel_err"]) for row in memory.values())
    model = (steps or {}).get("summary", {})
    out.update(model_median_abs_err=model.get("median_abs_err"), model_max_abs_err=model.get("max_abs_err"),
               n_model_configs=model.get("n_configs", 0),
               model_best_plan_hits=f"{model['best_plan_hits']}/{model['groups']}" if model else None)
    return out


def _show_held(held: dict[str, Any], memory: dict[str, Any], console) -> None:
    table = make_table("bytes per rank (MB), dp4", ("variant", "params", "grads", "optimizer", "at rest",
                                                    "peak state", "peak / DDP's"), left=("variant",))
    for name, row in held.items():
        table.add_row(name, *(f"{row[k] / 2**20:.1f}" for k in ("params", "grads", "optimizer", "total",
                                                                  "peak_state")),
                      f"{row['peak_state'] / held['ddp']['peak_state']:.3f}")
    console.print(table)
    table = make_table("the model's state at the peak (MB per rank), dp4",
                       ("variant", "predicted", "measured", "error"), left=("variant",))
    for name, row in memory.items():
        table.add_row(name, f"{row['predicted'] / 2**20:.1f}", f"{row['measured'] / 2**20:.1f}",
                      f"{row['rel_err']:+.1%}")
    console.print(table)


def _show_steps(steps: dict[str, Any], console) -> None:
    table = make_table("the model on sharded plans: step ms",
                       ("configuration", "plan", "predicted", "measured", "error"),
                       left=("configuration", "plan"))
    for row in steps["configs"]:
        table.add_row(row["name"], row["plan"], f"{row['predicted_s'] * 1e3:.1f}",
                      f"{row['measured_s'] * 1e3:.1f}", f"{row['rel_err']:+.1%}")
    console.print(table)
    for group, g in steps["groups"].items():
        console.print(f"{group}: predicted fastest {g['predicted_fastest']}, measured "
                      f"{g['measured_fastest']} -> {'hit' if g['hit'] else 'miss'}")
    console.print_json(data=steps["summary"])


def _speed(report: dict[str, Any], options: dict[str, Any], clusters: dict[str, int | None], json_out: str,
           console) -> None:
    for name, nodes in clusters.items():
        if nodes is None:
            result = launch("paraloom.bench.sharding:speed", options, nproc=4, prefix="paraloom-sharding-")[0]
        else:
            with emulated(nodes, 1e9, "shard") as cluster:
                result = launch("paraloom.bench.sharding:speed", options, cluster=cluster,
                                prefix="paraloom-sharding-")[0]
        report["speed"][name] = result
        shown = ("ddp", "fully_shard", "paraloom", *options["explain"])
        table = make_table(f"step ms, dp4, {name}", (*shown, "paraloom / fully_shard", "per round"))
        table.add_row(*(f"{result[f'{v}_step_s'] * 1e3:.1f}" for v in shown),
                      f"{result['ratio_vs_fully_shard']:.3f}",
                      " ".join(f"{r:.3f}" for r in result["ratio_per_round"]))
        console.print(table)
        write_json(json_out, report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, loopback, 2 rounds: a smoke run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-emulate", action="store_true", help="loopback only")
    parser.add_argument("--speed-only", action="store_true", help="skip the memory part")
    parser.add_argument("--model-only", action="store_true",
                        help="only the model's step time on sharded plans (emulated clusters, root), added "
                             "to the report at --json if there is one")
    parser.add_argument("--rates", nargs="+", choices=STEP_RATES, help="the model's link rates (default all)")
    parser.add_argument("--configs", nargs="+", choices=list(STEP_CONFIGS),
                        help="the model's configurations (default all)")
    parser.add_argument("--passes", type=int, help="the model's interleaved passes per rate (default 1 at "
                                                    "100 Mbit/s, 2 above)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory part, its entries replaced in the report at --json if there "
                             "is one")
    parser.add_argument("--explain", action="store_true",
                        help="add the bare loop clipping as paraloom does, paraloom without prefetch and "
                             "paraloom at FINE_UNITS")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    held_options = {"model": TINY if args.quick else BIG, "batch": 2, "levels": ["gradients", "full"],
                    "pipeline": True, "units": FINE_UNITS}
    speed_options = {"model": TINY if args.quick else SMALL, "batch": 8, "level": "full", "warmup": 2,
                     "steps": 2 if args.quick else 3,
                     "repeats": min(args.repeats, 2) if args.quick else args.repeats,
                     "explain": ["fully_shard_local_clip", "paraloom_no_prefetch", "paraloom_units"]
                     if args.explain else [], "units": FINE_UNITS}
    report: dict[str, Any] = {"options": {"held": held_options, "speed": speed_options}, "speed": {}}
    console = Console(width=120)
    emulate = not args.no_emulate and os.geteuid() == 0
    if (args.model_only or args.memory_only) and Path(args.json).is_file():
        report = json.loads(Path(args.json).read_text())
        if args.memory_only:
            report.setdefault("options", {})["held"] = held_options
    if (args.model_only or not args.quick) and not args.memory_only:
        report["step_model"] = None
    if not args.model_only:
        held = {} if args.speed_only else \
            launch("paraloom.bench.sharding:held", held_options, nproc=4, prefix="paraloom-sharding-")[0]
        report["held"] = held
        if held:
            report["memory_model"] = memory_model(held, held_options["model"], held_options["batch"])
            _show_held(held, report["memory_model"], console)
        write_json(args.json, report)
        clusters: dict[str, int | None] = {"loopback_4": None}
        if emulate and not args.quick:
            clusters["emulated_4x1gbit"] = 4
        if not args.memory_only:
            _speed(report, speed_options, clusters, args.json, console)
    if emulate and (args.model_only or not args.quick) and not args.memory_only:
        report["step_model"] = step_model(args.quick, console,
                                          lambda part: write_json(args.json, {**report, "step_model": part}),
                                          rates=args.rates, names=args.configs, passes=args.passes)
        _show_steps(report["step_model"], console)
    if report.get("held"):
        report["summary"] = summarize(report["held"], report["speed"], report.get("memory_model"),
                                      report.get("step_model"))
        console.print_json(data=report["summary"])
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

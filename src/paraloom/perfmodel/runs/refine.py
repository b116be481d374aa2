"""`paraloom calibrate --from`: a hardware profile's constants refined from finished runs (grey box:
the white-box formulas, constants fitted to what the runs measured)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.cpu import SERVER_PER_MESSAGE, SERVER_PER_UPDATE, server_cpu_per_message
from paraloom.perfmodel.cost.device import without_dispatch
from paraloom.perfmodel.cost.step_time import host_slowdown
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.plan import PIECE_OVERHEAD, PRIORITY_OVERHEAD, SYNC_OVERHEAD
from paraloom.perfmodel.runs.finished import finished, measured_and_predicted


def refine(hw: Hardware, run_dirs: list[Path]) -> tuple[Hardware, list[dict[str, float]]]:
    """Refine `hw` from finished runs, each kind fixing its own constants (grey box):

    - single-replica runs (one worker, or tensor and pipeline parallel): measured = a * compute +
      (predicted - compute) + c, compute without a CPU's per-op dispatch (which efficiency does not
      scale); efficiency is divided by a and c added to `step_overhead_s`. One
      run fixes a alone (c = 0); two or more give both by least squares. Repeats of one
      configuration (the same predicted compute) count as one point, their median.
    - data-parallel runs (several replicas): `sync_overhead_s`, what a synchronous step costs past
      its compute, update and overhead and its own measured communication (`comm_seconds_per_step`),
      per core's share of the host (`strategies.host_slowdown`), the median over them
      (`sync_residual`). Medians, so that one run slowed by a busy stretch of a shared machine
      does not move the constants when there are three repeats or more. Two slow ones still do:
      two single-worker MLP runs at 16.5 and 15.7 ms, against 13.7-14.8 ms, once fitted the
      overhead 2 ms high and the sync cost to 0.
    - parameter-server runs: `ps.server_s_per_message` and `ps.server_s_per_update`
      (`server_cpu_per_message`), each averaged over the runs that measured it.
    - data-parallel runs with the priority scheduler: `piece_overhead_s`, what a piece costs
      past its all-reduce's calibrated latency, and `priority_overhead_s`, the
      scheduler's own cost a step per core's share of the host (`piece_residual`): from runs
      with two piece sizes or more, the slope and intercept of their residuals over their pieces;
      from one size, its residual over its pieces alone. Fitted after `sync_overhead_s`, which
      comes from the other data-parallel runs only.
    """
    summaries = {run: finished(run)[0] for run in run_dirs}
    ps_runs = [run for run in run_dirs if "servers_stats" in summaries[run]]
    points, dp_runs = [], []
    for run in run_dirs:
        if run in ps_runs:
            continue
        measured, pred = measured_and_predicted(run, hw)
        if pred.plan.dp > 1:
            dp_runs.append(run)
            continue
        _, arithmetic = measured_and_predicted(run, without_dispatch(hw))  # what efficiency scales
        points.append({"run": str(run), "measured_s": measured, "predicted_s": pred.step_s,
                       "compute_s": arithmetic.breakdown["compute"]})
    refined = _fit_compute(hw, points) if points else hw
    if ps_runs:
        per_message = [server_cpu_per_message(summaries[run], refined) for run in ps_runs]
        points += [{"run": str(run), **m} for run, m in zip(ps_runs, per_message, strict=True)]
        fitted = {key: statistics.fmean(m[name] for m in per_message if name in m)
                  for key, name in ((SERVER_PER_MESSAGE, "server_s_per_message"),
                                    (SERVER_PER_UPDATE, "server_s_per_update"))
                  if any(name in m for m in per_message)}
        refined = replace(refined, constants={**refined.constants,
                                              **{k: max(0.0, v) for k, v in fitted.items()}})
    priority = [run for run in dp_runs if finished(run)[1].comm.scheduler == "priority"]
    plain = [run for run in dp_runs if run not in priority]
    if plain:
        residuals = [sync_residual(run, summaries[run], refined) for run in plain]
        points += [{"run": str(run), **r} for run, r in zip(plain, residuals, strict=True)]
        value = statistics.median(r["sync_overhead_s"] for r in residuals)
        refined = replace(refined, constants={**refined.constants, SYNC_OVERHEAD: max(0.0, value)})
    if priority:
        residuals = [piece_residual(run, refined) for run in priority]
        points += [{"run": str(run), **r} for run, r in zip(priority, residuals, strict=True)]
        slope, intercept = _fit_line([(r["piece_units"], r["residual_s"]) for r in residuals])
        if slope < 0:  # noise: more pieces measured faster; what they share is left
            slope, intercept = 0.0, statistics.median(r["residual_s"] for r in residuals)
        share = statistics.median(r["host_share"] for r in residuals)
        refined = replace(refined, constants={**refined.constants, PIECE_OVERHEAD: slope,
                                              PRIORITY_OVERHEAD: max(0.0, intercept) / share})
    return refined, points


def piece_residual(run: Path, hw: Hardware) -> dict[str, float]:
    """A priority run's step past the model's without the scheduler's own costs, and the units
    `piece_overhead_s` is charged in there (its pieces: two predictions 1 ms apart)."""
    base = replace(hw, constants={**hw.constants, PIECE_OVERHEAD: 0.0, PRIORITY_OVERHEAD: 0.0})
    measured, pred = measured_and_predicted(run, base)
    _, unit = measured_and_predicted(run, replace(base, constants={**base.constants, PIECE_OVERHEAD: 1e-3}))
    per_unit = (unit.step_s - pred.step_s) / 1e-3
    if per_unit <= 0:
        raise UserError(f"{str(run)!r}: its plan sends no priority pieces the model can charge")
    return {"measured_s": measured, "predicted_s": pred.step_s, "piece_units": per_unit,
            "residual_s": measured - pred.step_s, "host_share": host_slowdown(hw, pred.plan)}


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of (x, y) points, repeats of an x as their median; one x: through 0."""
    repeats: dict[float, list[float]] = {}
    for x, y in points:
        repeats.setdefault(round(x, 12), []).append(y)
    xs, ys = list(repeats), [statistics.median(v) for v in repeats.values()]
    if len(xs) == 1:
        return ys[0] / xs[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return a, my - a * mx


def sync_residual(run: Path, summary: dict[str, Any], hw: Hardware) -> dict[str, float]:
    """A data-parallel run's step past what the model charges besides communication, with the
    communication the run measured (its time waiting for gradients, `comm_seconds_per_step`) in
    place of the predicted: the ranks waiting for the slowest at the step's synchronization, the
    engine's per-step work, the processes' contention for the host. Per core's share of the host
    (`strategies.host_slowdown`), as the overhead it adds to."""
    measured, pred = measured_and_predicted(run, hw)
    rest = pred.step_s - pred.breakdown["dp_comm_exposed"] - pred.breakdown.get("sync", 0.0)
    slow = host_slowdown(hw, pred.plan)
    residual = measured - summary["comm_seconds_per_step"] - rest
    return {"measured_s": measured, "comm_s": summary["comm_seconds_per_step"], "rest_s": rest,
            "sync_overhead_s": residual / slow}


def _fit_compute(hw: Hardware, points: list[dict[str, float]]) -> Hardware:
    # predicted compute -> the run's measured step less the rest of its prediction
    a, c = _fit_line([(p["compute_s"], p["measured_s"] - p["predicted_s"] + p["compute_s"]) for p in points])
    if a <= 0:
        raise UserError("the runs do not fit a positive compute scale; give runs with different models "
                        "or batch sizes")
    c = max(0.0, c)
    efficiency = {k: v / a for k, v in hw.device.efficiency.items()}
    top = max(efficiency.values())  # a fraction of peak stays <= 1: a faster machine raises the peak
    peak = {k: v * max(1.0, top) for k, v in hw.device.peak_flops.items()}
    efficiency = {k: v / max(1.0, top) for k, v in efficiency.items()}
    device = replace(hw.device, efficiency=efficiency, peak_flops=peak)
    overhead = hw.constants.get("step_overhead_s", 0.0) + c
    return replace(hw, device=device, constants={**hw.constants, "step_overhead_s": overhead})

"""A run's prediction of itself, term by term, and its comparison with what the run measures.

Before its first step a run predicts its step from a hardware profile and nothing measured in
the run (`predict`); while it trains, every rank records its own terms per step from the timers
the loop, the engine and the pipeline keep anyway (`Contract.record`: no synchronization), and
rank 0 warns once per term whose median misses its prediction by more than
`run.contract_tolerance` of the predicted step. The terms:

    compute        forward and backward (tensor-parallel collectives run inside the layers)
    data           waiting for the batch: loading, collating, the copy to the device
    communication  data-parallel or parameter-server communication not hidden behind compute
    codec          compressing and decompressing gradients
    bubble         a pipeline's idle time and its point-to-point transfers
    update         the optimizer step
    overhead       the rest of the step: host work the model prices as per-step constants
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

from paraloom.config.choices import FULLY_SHARDED

MIN_ROWS = 20  # steps measured after warm-up before a median is trusted enough to warn
WINDOW = 4096  # the medians are the last so many steps' (a long run's memory stays flat)
TERMS = ("compute", "data", "communication", "codec", "bubble", "update", "overhead")
CAUSES = {
    "compute": "forward and backward run slower than calibrated: other load on the machine, other threads "
               "per worker, a profile of another machine, or layers that cost more than the model prices "
               "them",
    "data": "the input pipeline (loading and collating batches): raise data.workers",
    "communication": "the link is slower than calibrated, or shared with other traffic",
    "codec": "compressing and decompressing gradients run slower than calibrated",
    "bubble": "pipeline stages out of balance, or slow point-to-point transfers between them",
    "update": "the optimizer step runs slower than calibrated, or does work per tensor the model does not "
              "price",
    "overhead": "per-step host work the model does not price (Python, logging, checkpoints, guards)",
}
# terms priced from rates a calibration measured on this machine: where the profile is the one cached
# on first use, the machine may have changed since (other load, another host behind the same name)
CALIBRATED = ("compute", "communication", "codec", "update")
STALE_AFTER_H = 1.0  # a cached profile this old or older may no longer describe the machine
RECHECKED = ("compute", "update")  # on a CPU profile cached here, measured again after the run (recheck.py)


def predicted_terms(estimate) -> dict[str, float]:
    """An `Estimate`'s breakdown as the terms a run measures; they add up to its step. A pipeline's
    compute is its slowest stage's (the one that sets the pace), tensor-parallel collectives included."""
    b = estimate.breakdown
    terms = {"data": b["data"], "codec": b["codec"], "bubble": b["bubble"] + b["pp_comm"],
             "update": b["update"], "overhead": b["overhead"] + b["sync"] + b["straggler"]}
    if estimate.plan.servers:  # the servers update: a worker waits for it with its push and pull
        terms["compute"], terms["update"] = b["compute"], 0.0
        terms["communication"] = max(0.0, estimate.step_s - sum(terms.values()))
    else:
        # a fully sharded run's gathers and reduce-scatters sit inside its forward and backward, which
        # it measures as compute (train/strategies/fully_sharded.py): their exposed time is compute here
        sharded = estimate.plan.shard in FULLY_SHARDED
        terms["communication"] = 0.0 if sharded else b["dp_comm_exposed"]
        terms["compute"] = estimate.step_s - sum(terms.values())  # the pipeline less its bubble
    return {term: terms[term] for term in TERMS}


def predict(cfg, workers: int, hardware) -> dict[str, Any]:
    """The run's predicted step, by term, and peak memory per rank, from `hardware` alone."""
    from paraloom.config.choices import SCHEDULERS
    from paraloom.perfmodel.cost.mfu import mfu, model_flops_per_sample, peak_flops
    from paraloom.perfmodel.cost.step_time import estimate
    from paraloom.perfmodel.from_config import predictable
    from paraloom.perfmodel.measure.profile import profile_model, with_units

    what = with_units(predictable(cfg, workers))
    dtype = cfg.run.precision
    profile = profile_model(what.spec, dtype=dtype, recompute=what.recompute, data=what.data)
    plans = [what.plan]
    if cfg.comm.scheduler == "auto":  # the run keeps the fastest it measures: the model's fastest, priced
        plans = [dataclasses.replace(what.plan, scheduler=name) for name in SCHEDULERS]
    est = min((estimate(profile, hardware, p, what.global_batch, what.options) for p in plans),
              key=lambda e: e.step_s)
    plan = est.plan
    per_rank = [est.memory_per_stage[_stage_of(rank, plan)] for rank in range(plan.dp * plan.tp * plan.pp)]
    flops = model_flops_per_sample(profile) * what.global_batch
    peak = peak_flops(hardware, dtype, plan.devices)
    return {"hardware": hardware.name, "plan": plan.label(), "model": what.spec,
            "step_seconds": est.step_s, "terms": predicted_terms(est),
            "peak_memory_bytes_per_rank": per_rank,
            "model_flops_per_step": flops, "peak_flops": peak, "mfu": mfu(flops, est.step_s, peak)}


def _stage_of(rank: int, plan) -> int:
    from paraloom.topology import Topology

    return Topology(dp=plan.dp, tp=plan.tp, pp=plan.pp).coord(rank).pp


class Contract:
    """One rank's measured terms, step by step after warm-up, held against the prediction."""

    def __init__(self, predicted: dict[str, Any] | None, *, tolerance: float, warmup: int,
                 speaks: bool) -> None:
        self.given = predicted  # as written, a reason in place of the terms where there is none
        self.predicted = predicted if predicted is not None and "terms" in predicted else None
        self.tolerance, self.warmup, self.speaks = tolerance, warmup, speaks
        self.rows: collections.deque[dict[str, float]] = collections.deque(maxlen=WINDOW)
        self.pending: list[tuple[dict[str, float], tuple]] = []  # rows whose GPU times are not read yet
        self.seen = 0
        self.warned: set[str] = set()

    def record(self, step_seconds: float, terms: dict[str, Any]) -> None:
        """One step's wall time and its measured terms; `overhead` is what they leave of the step.
        On a GPU (`gpu_events` among the terms) compute and update are the stream's own times,
        read once the events have long completed (`medians`)."""
        self.seen += 1
        if self.seen <= self.warmup:
            return
        row = {term: terms.get(term, 0.0) for term in TERMS}
        row["step"] = step_seconds
        if "gpu_events" in terms:
            self.pending.append((row, terms["gpu_events"]))
        else:
            _rest(row)
        self.rows.append(row)

    def _settle(self) -> None:
        for row, (start, middle, end) in self.pending:
            end.synchronize()  # steps ago: long done, unless this is the last step's
            row["compute"], row["update"] = start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3
            _rest(row)
        self.pending.clear()

    def medians(self) -> dict[str, float] | None:
        self._settle()
        if not self.rows:
            return None
        return {key: statistics.median(row[key] for row in self.rows) for key in ("step", *TERMS)}

    def check(self) -> list[str]:
        """Warn (rank 0, once per term) about terms off by more than the tolerance so far."""
        if not self.speaks or self.predicted is None or len(self.rows) < MIN_ROWS:
            return []
        measured = self.medians()
        new = [t for t in off_terms(self.predicted, measured, self.tolerance) if t not in self.warned]
        for term in new:
            self.warned.add(term)
            print(f"paraloom: warning: {warning(term, self.predicted, measured)}", file=sys.stderr)
        return new


def _rest(row: dict[str, float]) -> None:
    row["overhead"] = max(0.0, row["step"] - sum(row[t] for t in TERMS if t != "overhead"))


def off_terms(predicted: dict[str, Any], measured: dict[str, float], tolerance: float) -> list[str]:
    """Terms whose measured median misses the prediction by more than `tolerance` x predicted step."""
    bound = tolerance * predicted["step_seconds"]
    return [t for t in TERMS if abs(measured[t] - predicted["terms"][t]) > bound]


def spread_miss(contract: dict[str, Any]) -> str:
    """Where the step misses its prediction by more than the tolerance and no term does alone, one
    line naming the terms that make up the miss, largest first ("" otherwise)."""
    predicted, measured, tolerance = contract["predicted"], contract["measured"], contract["tolerance"]
    if contract.get("off") or abs(contract["step_error"]) <= tolerance:
        return ""
    misses = sorted(((measured[t] - predicted["terms"][t], t) for t in TERMS), key=lambda m: -abs(m[0]))
    shown = ", ".join(f"{term} {miss * 1e3:+.2f} ms" for miss, term in misses
                      if abs(miss) >= 0.05 * abs(measured["step"] - predicted["step_seconds"]))
    return (f"the step misses its prediction by {contract['step_error']:+.0%}, though no term alone misses "
            f"it by more than {tolerance:.0%} of the predicted step: {shown}")


def spread_calibrated(contract: dict[str, Any]) -> list[str]:
    """The calibrated terms behind a spread miss (`spread_miss`), where they make more than half of
    it: those missing the step's way by 5% of its miss or more ([] otherwise: the miss is the data's,
    Python's, or no spread miss at all). A stale profile, or the model's pricing, may be why."""
    if not spread_miss(contract):
        return []
    predicted, measured = contract["predicted"], contract["measured"]
    miss = measured["step"] - predicted["step_seconds"]
    parts = {t: measured[t] - predicted["terms"][t] for t in CALIBRATED}
    if sum(parts.values()) * miss <= 0 or abs(sum(parts.values())) <= abs(miss) / 2:
        return []
    return [t for t, part in parts.items() if part * miss > 0 and abs(part) >= 0.05 * abs(miss)]


def warning(term: str, predicted: dict[str, Any], measured: dict[str, float]) -> str:
    p, m = predicted["terms"][term], measured[term]
    ratio = f"{m / p:.1f}x" if p > 0 else "more than"
    hint = stale_hint(predicted) if term in CALIBRATED else ""
    if term in RECHECKED and predicted.get("hardware_threads"):  # a CPU profile of this machine, any age
        hint = "`paraloom train` measures the machine again at the run's end to tell which"
    return (f"{term} takes {m * 1e3:.2f} ms a step, {ratio} the {p * 1e3:.2f} ms predicted from hardware "
            f"profile {predicted['hardware']!r} (step {measured['step'] * 1e3:.2f} ms, predicted "
            f"{predicted['step_seconds'] * 1e3:.2f} ms); likely cause: {CAUSES[term]}"
            + (f"; {hint}" if hint else ""))


def stale_hint(predicted: dict[str, Any], now: datetime.datetime | None = None) -> str:
    """Where the prediction came from this machine's cached profile, calibrated `STALE_AFTER_H` hours
    ago or more: its age and how to measure again ("" otherwise: a profile just made describes the
    machine as it is, so measuring again would not help)."""
    path, measured = predicted.get("hardware_file"), predicted.get("hardware_measured")
    if not path or not measured:
        return ""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    hours = (now - datetime.datetime.fromisoformat(measured)).total_seconds() / 3600
    if hours < STALE_AFTER_H:
        return ""
    age = f"{hours:.0f} h" if hours < 48 else f"{hours / 24:.0f} days"
    return (f"the profile is this machine's as calibrated {age} ago ({path}); delete that file to "
            "calibrate again on the next run")


def _measured_at(path: Path) -> str:
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return stamp.isoformat(timespec="seconds")


def report(predicted: dict[str, Any] | None, per_rank: list[dict[str, float] | None], *,
           tolerance: float) -> dict[str, Any]:
    """summary.json's "contract": predicted and measured side by side. The measured terms are the
    rank that computes longest (it sets a synchronous step's pace): its terms add up to its step."""
    ranks = [row for row in per_rank if row is not None]
    out: dict[str, Any] = {"tolerance": tolerance, "predicted": predicted, "measured_per_rank": per_rank}
    if not ranks:
        return out
    pace = max(ranks, key=lambda row: row["compute"])
    out["measured"] = pace
    if predicted is not None and "terms" in predicted:
        out["step_error"] = pace["step"] / predicted["step_seconds"] - 1.0
        out["off"] = off_terms(predicted, pace, tolerance)
        if "model_flops_per_step" in predicted:  # model FLOPs utilisation (cost/mfu.py), measured
            from paraloom.perfmodel.cost.mfu import mfu

            out["mfu"] = mfu(predicted["model_flops_per_step"], pace["step"], predicted["peak_flops"])
    return out


PREDICTION = "prediction.json"


def load_or_predict(run_dir, cfg, workers: int, threads: int, device: str = "cpu", *,
                    cached: Path | None = None) -> dict[str, Any]:
    """Rank 0's prediction of the run in `run_dir` on `device` ("cpu" or "cuda"): made before its
    first step and written to prediction.json, or read back from there on a restart. Never stops
    the run: a model or a profile it cannot price gives {"error": ...} and one line on stderr.
    `cached`: the machine's cached profile to price it with in place of the one `run.hardware=auto`
    reads (the launcher's, for a run on an emulated cluster: its links measured across one)."""
    import json

    from paraloom.files import write_json
    from paraloom.perfmodel.hardware import load_hardware
    from paraloom.perfmodel.measure.machine_profile import cached_source, resolve_hardware

    path = run_dir / PREDICTION
    if path.is_file():
        return json.loads(path.read_text())
    try:
        hardware = load_hardware(cached) if cached else resolve_hardware(cfg.run.hardware, threads, device)
        if hardware is None:
            predicted = {"skipped": "run.hardware=none" if cfg.run.hardware == "none" else
                         "no hardware profile of this machine yet: `paraloom train` makes one on first use"}
        else:
            predicted = predict(cfg, workers, hardware)
            source = cached or cached_source(cfg.run.hardware, threads, device)
            if source is not None:  # named by a warning, should a calibrated term come out off
                predicted.update(hardware_file=str(source), hardware_measured=_measured_at(source))
                if device == "cpu":  # what to measure again with (perfmodel/runs/recheck.py)
                    predicted["hardware_threads"] = threads
            if cached:
                predicted["hardware_chosen"] = str(cached)
    except Exception as exc:  # noqa: BLE001 (a prediction that fails must not stop the training)
        predicted = {"error": f"{type(exc).__name__}: {exc}"}
    write_json(path, predicted)
    if "terms" in predicted:
        print(f"paraloom: predicted step {predicted['step_seconds'] * 1e3:.2f} ms ({predicted['plan']}, "
              f"hardware profile {predicted['hardware']!r}); {path}", file=sys.stderr)
    elif "error" in predicted:
        print(f"paraloom: note: no prediction of this run: {predicted['error']}", file=sys.stderr)
    return predicted


def replan(run_dir, cfg, old_workers: int, new_workers: int, threads: int, *,
           old_cfg=None, device: str = "cpu") -> dict[str, float | None]:
    """A resize's predicted step seconds at the old size and at the new one (None where the profile
    cannot price it); prediction.json is made again, for the new size, and the new one printed.
    `old_cfg`: the settings of the old size where they differ (another number of parameter servers)."""
    import json

    from paraloom.perfmodel.hardware import load_hardware
    from paraloom.perfmodel.measure.machine_profile import resolve_hardware

    path = run_dir / PREDICTION
    # a profile the launcher chose (an emulated cluster's) goes on pricing the run at its new size
    chosen = json.loads(path.read_text()).get("hardware_chosen") if path.is_file() else None
    cached = Path(chosen) if chosen and Path(chosen).is_file() else None
    path.unlink(missing_ok=True)
    try:
        hardware = load_hardware(cached) if cached else resolve_hardware(cfg.run.hardware, threads, device)
        old = predict(old_cfg or cfg, old_workers, hardware)["step_seconds"] if hardware is not None else None
    except Exception:  # noqa: BLE001 (as load_or_predict: a prediction never stops the run)
        old = None
    new = load_or_predict(run_dir, cfg, new_workers, threads, device, cached=cached).get("step_seconds")
    return {"predicted_step_seconds_old": old, "predicted_step_seconds_new": new}

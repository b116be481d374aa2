"""A finished run as refinement reads it: its summary and config, its steady-state step, its
prediction on a profile, and why it cannot be fitted to."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.cpu import server_cpu_per_message
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import Hardware


def measured_step_seconds(run: Path) -> float:
    """A finished run's steady-state seconds per step: the median step (tensor and pipeline runs),
    all workers' throughput (parameter server), or the median of the logged intervals after the
    first (data parallel: the first holds the warm-up)."""
    summary, cfg = finished(run)
    if "grid" in summary:
        return summary["step_seconds"]
    if "servers" in summary:
        return _per_step(run, summary, cfg.data.batch_size)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    rows = [json.loads(line) for line in lines if line]
    rates = [row["samples_per_s"] for row in rows[1:] or rows]
    if not rates:
        return summary.get("step_seconds") or _per_step(run, summary, cfg.data.batch_size)
    return cfg.data.batch_size / statistics.median(rates)


def _per_step(run: Path, summary: dict[str, Any], batch: int) -> float:
    if not summary.get("samples_per_second"):
        raise UserError(f"{str(run)!r} measured no throughput (too few steps): nothing to fit to")
    return batch / summary["samples_per_second"]


def finished(run: Path) -> tuple[dict[str, Any], Any]:
    """(summary, config) of finished run `run` (UserError where either file is missing)."""
    from paraloom.config import load_config

    summary_path, config_path = run / "summary.json", run / "config.yaml"
    if not summary_path.is_file() or not config_path.is_file():
        raise UserError(f"{str(run)!r} is not a finished run directory (summary.json and config.yaml)")
    return json.loads(summary_path.read_text()), load_config(str(config_path), [])


def unusable(run: Path, hw: Hardware) -> str | None:
    """Why `refine` cannot price finished run `run` with `hw` now (its config no longer loads, its
    model's factory no longer imports, its summary is damaged), or should not (it injected faults:
    its steps were slowed or redone on purpose), or None where it can."""
    try:
        summary, cfg = finished(run)
        if cfg.run.inject:
            return f"it injected faults (run.inject={cfg.run.inject})"
        if "servers_stats" not in summary:
            measured_and_predicted(run, hw)
        elif not summary.get("steps") or not summary.get("workers"):  # refine takes its servers' CPU
            return "its servers served no step: nothing to fit to"
        else:
            server_cpu_per_message(summary, hw)
    except UserError as exc:
        return str(exc)
    except (ValueError, KeyError, TypeError) as exc:  # a summary or metrics file cut short or edited
        return f"{type(exc).__name__}: {exc}"
    return None


def measured_and_predicted(run: Path, hw: Hardware):
    """(the run's measured step seconds, the model's Estimate of its plan on `hw`)."""
    from paraloom.perfmodel.from_config import predictable
    from paraloom.perfmodel.measure.profile import profile_model, with_units

    summary, cfg = finished(run)
    world = int(summary.get("world_size") or cfg.parallel.nproc)
    what = with_units(predictable(cfg, world - (cfg.ps.servers if cfg.parallel.mode == "ps" else 0)))
    profile = profile_model(what.spec, recompute=what.recompute, data=what.data)
    return measured_step_seconds(run), estimate(profile, hw, what.plan, what.global_batch, what.options)

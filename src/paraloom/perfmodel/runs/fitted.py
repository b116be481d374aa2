"""Grey and black boxes fitted to measured runs, scored leave-one-out beside the white box.

    white  the white box's predicted step: formulas, constants from micro-benchmarks
    grey   the white box's terms, each scaled by a factor fitted to measured runs; a ridge pulls
           every factor toward 1, so that with few runs it stays the white box
    black  a ridge regression of the measured step's logarithm on configuration features
           (workers, tensor / pipeline / parameter-server / compressed) and the white box's
           compute, communication and step, logged

Each run is a dict with "config", "world_size", "predicted" ({"step_seconds", "terms"}) and
"measured" ({"step"}), as the history holds them. Errors are relative: predicted / measured - 1.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from paraloom.perfmodel.runs.contract import TERMS

GREY_RIDGE = 0.1  # against the squared relative errors summed over the runs
BLACK_RIDGE = 0.1
EPS = 1e-5  # seconds: a term of 0 still has a logarithm


def usable(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs with a white-box prediction and a measured step."""
    return [r for r in runs
            if (r.get("predicted") or {}).get("terms") and (r.get("measured") or {}).get("step")]


def _terms(run: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([run["predicted"]["terms"][t] for t in TERMS], dtype=torch.float64)


def fit_grey(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per-term factors s minimizing sum_i (s . terms_i / measured_i - 1)^2 + GREY_RIDGE |s - 1|^2."""
    if not runs:
        return dict.fromkeys(TERMS, 1.0)
    a = torch.stack([_terms(r) / r["measured"]["step"] for r in runs])
    ones = torch.ones(len(TERMS), dtype=torch.float64)
    lhs = a.T @ a + GREY_RIDGE * torch.eye(len(TERMS), dtype=torch.float64)
    s = torch.linalg.solve(lhs, a.T @ torch.ones(len(runs), dtype=torch.float64) + GREY_RIDGE * ones)
    return dict(zip(TERMS, s.tolist(), strict=True))


def predict_grey(run: dict[str, Any], scales: dict[str, float]) -> float:
    return sum(scales[t] * run["predicted"]["terms"][t] for t in TERMS)


def features(run: dict[str, Any]) -> list[float]:
    cfg, predicted = run["config"], run["predicted"]
    par, comm = cfg.get("parallel", {}), cfg.get("comm", {})
    terms = predicted["terms"]
    return [1.0, math.log(terms["compute"] + EPS), math.log(terms["communication"] + EPS),
            math.log(predicted["step_seconds"] + EPS), math.log(max(1, run.get("world_size") or 1)),
            float(par.get("tp", 1) > 1), float(par.get("pp", 1) > 1), float(par.get("mode") == "ps"),
            float(comm.get("compressor", "none") != "none")]


def fit_black(runs: list[dict[str, Any]]) -> list[float]:
    """Ridge least squares of log(measured step) on `features` (the intercept not pulled)."""
    x = torch.tensor([features(r) for r in runs], dtype=torch.float64)
    y = torch.tensor([math.log(r["measured"]["step"]) for r in runs], dtype=torch.float64)
    pull = BLACK_RIDGE * torch.eye(x.shape[1], dtype=torch.float64)
    pull[0, 0] = 0.0
    return torch.linalg.solve(x.T @ x + pull, x.T @ y).tolist()


def predict_black(run: dict[str, Any], weights: list[float]) -> float:
    return math.exp(sum(w * f for w, f in zip(weights, features(run), strict=True)))


def leave_one_out(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run predicted by the white box, and by grey and black boxes fitted to all the others."""
    runs = usable(runs)
    rows = []
    for i, run in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        measured = run["measured"]["step"]
        row = {"white": run["predicted"]["step_seconds"] / measured - 1,
               "grey": predict_grey(run, fit_grey(others)) / measured - 1}
        row["black"] = predict_black(run, fit_black(others)) / measured - 1 if len(others) >= 2 else None
        rows.append(row)
    out: dict[str, Any] = {"n": len(rows), "errors": rows}
    for box in ("white", "grey", "black"):
        errors = [abs(r[box]) for r in rows if r[box] is not None]
        out[box] = None if not errors else {"median_abs_err": statistics.median(errors),
                                            "max_abs_err": max(errors)}
    return out

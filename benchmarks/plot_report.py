"""The plots BENCHMARKS.md links, drawn from the committed result files (nothing hard-coded).

    python benchmarks/plot_report.py [--results benchmarks/results] [--out benchmarks/plots]

  collectives_4x1gbit.png     bus bandwidth against message size, every all-reduce algorithm
                              (results/collectives_4x1gbit.json)
  perfmodel_validation.png    each run's own prediction against its measured step, 33 emulated-cluster
                              configurations (results/perfmodel_validation_contract_run14.json)
  perfmodel_published.png     the model's error on each published GPU-cluster case, fit and held out
                              (results/perfmodel_published.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
VALIDATION = "perfmodel_validation_contract_run14.json"


def saved(fig, path: Path) -> Path:
    """Write `fig` to `path` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / name).read_text())


def collectives(results: Path, out: Path) -> Path:
    report = load(results, "collectives_4x1gbit.json")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for algorithm in report["config"]["algorithms"]:
        rows = sorted((r for r in report["results"] if r["algorithm"] == algorithm),
                      key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in rows], [r["busbw_MBps"] for r in rows], marker="o", ms=3,
                label=algorithm)
    link = report["link_MBps"]
    ax.axhline(link, color="grey", ls="--", lw=1, label=f"link, {link:.1f} MB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce size, bytes (float32)")
    ax.set_ylabel("bus bandwidth, MB/s")
    ax.set_title(f"{report['config']['transport']}, {report['config']['date']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    path = out / "collectives_4x1gbit.png"
    return saved(fig, path)


def validation(results: Path, out: Path) -> Path:
    report = load(results, VALIDATION)
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    for rate in ("100mbit", "1gbit", "10gbit"):
        configs = [c for c in report["configs"] if c["rate"] == rate]
        ax.scatter([c["measured_s"] * 1e3 for c in configs], [c["self_predicted_s"] * 1e3 for c in configs],
                   s=18, label=rate)
    every = [c["measured_s"] * 1e3 for c in report["configs"]]
    low, high = min(every) * 0.7, max(every) * 1.3
    ax.plot([low, high], [low, high], color="black", lw=1, label="predicted = measured")
    for factor in (0.75, 1.25):
        ax.plot([low, high], [low * factor, high * factor], color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured step, ms")
    ax.set_ylabel("the run's own prediction, ms")
    summary = report["summary"]
    ax.set_title(f"{summary['n_configs']} configurations, {report['date']}: median |error| "
                 f"{summary['self_median_abs_err']:.1%}, largest {summary['self_max_abs_err']:.1%} "
                 "(dashed: +-25%)", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    path = out / "perfmodel_validation.png"
    return saved(fig, path)


def published(results: Path, out: Path) -> Path:
    report = load(results, "perfmodel_published.json")
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for split in ("fit", "heldout"):
        rows = sorted((r for r in report["rows"] if r["split"] == split), key=lambda r: r["error"])
        n = len(rows)
        ax.plot([(i + 0.5) / n for i in range(n)], [r["error"] * 100 for r in rows], marker="o", ms=3,
                ls="none", label=f"{split} ({n} cases)")
    ax.axhspan(-15, 15, color="green", alpha=0.08, label="within 15%")
    ax.axhline(0, color="black", lw=0.8)
    summary = report["summary"]
    ax.set_xlabel("cases of the split, sorted by error (share)")
    ax.set_ylabel("predicted / measured - 1, %")
    ax.set_title(f"held out: {summary['heldout_within_15pct']:.1%} within 15%, median |error| "
                 f"{summary['heldout_median_abs_err']:.2%}; fit: {summary['fit_within_15pct']:.1%}, "
                 f"{summary['fit_median_abs_err']:.2%}", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    path = out / "perfmodel_published.png"
    return saved(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "plots")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (collectives, validation, published):
        print(draw(args.results, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Predicted throughput and scaling efficiency against node count, one line per (tp, pp) family."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def families(results) -> dict[str, list[tuple[int, float]]]:
    """(nodes, best samples/s) per "tp T pp P" family, over the node counts where one fits."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        best: dict[str, float] = {}
        for e in r.estimates:
            key = f"tp{e.plan.tp} pp{e.plan.pp}" + (" ps" if e.plan.servers else "")
            best[key] = max(best.get(key, 0.0), e.samples_per_s)
        for key, value in best.items():
            out.setdefault(key, []).append((r.nodes, value))
    return out


def plot_scaling(results, path: Path, *, title: str) -> None:
    """Two panels: samples/s and efficiency (per-node throughput against the first node count's best)."""
    lines = families(results)
    first = next(r for r in results if r.estimates)
    base = first.best.samples_per_s / first.nodes
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    speed, eff = fig.subplots(1, 2)
    for key, points in sorted(lines.items(), key=lambda kv: -max(v for _, v in kv[1])):
        nodes = [n for n, _ in points]
        speed.plot(nodes, [v for _, v in points], marker="o", label=key)
        eff.plot(nodes, [v / n / base for n, v in points], marker="o", label=key)
    for ax, name in ((speed, "samples/s (predicted)"), (eff, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    speed.set_yscale("log")
    eff.axhline(1.0, color="grey", lw=0.8)
    speed.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

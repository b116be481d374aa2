"""Plots of a run: the ranks' traced timelines and the metrics curves (matplotlib, Agg canvas)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from paraloom.config.errors import UserError

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "comm": "#55a868", "step": "#bdbdbd",
          "other": "#8172b3"}
LANE_ORDER = ("step", "compute", "comm")  # other lanes follow, by name


@dataclass(frozen=True)
class _Span:
    rank: int
    lane: str
    name: str
    start_ms: float  # on a clock shared by every rank's file
    dur_ms: float

    @property
    def kind(self) -> str:
        head = self.name.split(" ", 1)[0]
        if self.lane == "compute" and head in ("forward", "backward"):
            return head
        if self.lane == "compute" and head[:1] in ("F", "B") and head[1:].isdigit():  # a pipeline stage's
            return "forward" if head[0] == "F" else "backward"
        if self.lane in ("p2p", "tp"):  # pipeline sends and waits, tensor-parallel collectives
            return "comm"
        return self.lane if self.lane in ("comm", "step") else "other"


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {what} {str(path)!r}: {exc.__class__.__name__}") from None


def load_spans(trace_paths: list[Path]) -> list[_Span]:
    """Complete events of every file, lined up on the wall clock each Timeline noted at its start."""
    docs = [(path, _read_json(path, "trace file")) for path in trace_paths]
    origins = [doc.get("otherData", {}).get("origin_unix_s") if isinstance(doc, dict) else None
               for _, doc in docs]
    aligned = all(isinstance(o, (int, float)) for o in origins)
    first = min(origins) if aligned and origins else 0.0
    spans = []
    for (path, doc), origin in zip(docs, origins, strict=True):
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise UserError(f"{str(path)!r} is not a Chrome trace (no traceEvents list)")
        events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
        lanes = {e.get("tid"): e.get("args", {}).get("name") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        shift_ms = (origin - first) * 1e3 if aligned else 0.0
        for e in events:
            if e.get("ph") != "X":
                continue
            lane = lanes.get(e.get("tid")) or e.get("cat") or f"tid {e.get('tid')}"
            spans.append(_Span(int(e.get("pid", 0)), str(lane), str(e.get("name", "")),
                               float(e["ts"]) / 1e3 + shift_ms, float(e.get("dur", 0.0)) / 1e3))
    return spans


def _window(spans: list[_Span], max_steps: int | None) -> list[_Span]:
    """Spans that start before the end of each rank's first `max_steps` step spans."""
    if max_steps is None:
        return spans
    steps: dict[int, list[_Span]] = {}
    for s in sorted((s for s in spans if s.lane == "step"), key=lambda s: s.start_ms):
        steps.setdefault(s.rank, []).append(s)
    if not steps:
        return spans
    end = max(s.start_ms + s.dur_ms for per_rank in steps.values() for s in per_rank[:max_steps])
    return [s for s in spans if s.start_ms < end]


def _rows(spans: list[_Span]) -> list[tuple[int, str]]:
    present = {(s.rank, s.lane) for s in spans}

    def lane_key(lane: str) -> tuple[int, str]:
        return (LANE_ORDER.index(lane) if lane in LANE_ORDER else len(LANE_ORDER), lane)

    return sorted(present, key=lambda row: (row[0], lane_key(row[1])))


def render_timeline(trace_paths: list[Path], out_png: Path, *, max_steps: int | None = None,
                    title: str | None = None) -> Path:
    """One row per (rank, lane): forward, backward, communication and steps against time in ms."""
    spans = _window(load_spans(trace_paths), max_steps)
    if not spans:
        raise UserError("the trace holds no spans: tracing starts at the second step, "
                        "so train for at least 2 steps")
    t0 = min(s.start_ms for s in spans)
    rows = _rows(spans)
    row_of = {row: i for i, row in enumerate(rows)}
    fig = Figure(figsize=(12, 1.4 + 0.34 * len(rows)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    kinds_seen: set[str] = set()
    by_row_kind: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in spans:
        by_row_kind.setdefault((row_of[(s.rank, s.lane)], s.kind), []).append((s.start_ms - t0, s.dur_ms))
        kinds_seen.add(s.kind)
    for (y, kind), bars in by_row_kind.items():
        height = 0.4 if kind == "step" else 0.8
        ax.broken_barh(bars, (y - height / 2, height), facecolors=COLORS[kind], edgecolor="none")
    for s in spans:
        if s.lane == "step":
            ax.text(s.start_ms - t0 + s.dur_ms / 2, row_of[(s.rank, s.lane)], s.name,
                    ha="center", va="center", fontsize=7, clip_on=True)
    for y, (rank, _lane) in enumerate(rows[1:], start=1):
        if rows[y - 1][0] != rank:
            ax.axhline(y - 0.5, color="#cccccc", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"rank {rank} {lane}" for rank, lane in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    order = ("forward", "backward", "comm", "step", "other")
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in order if k in kinds_seen],
               loc="outside right upper", fontsize=8)
    ranks = sorted({s.rank for s in spans})
    step_numbers = sorted({s.name for s in spans if s.lane == "step"}, key=_step_number)
    what = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    if step_numbers:
        what += f", {step_numbers[0]}" + (f" to {step_numbers[-1]}" if len(step_numbers) > 1 else "")
    ax.set_title(f"{title}: {what}" if title else what)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


def _step_number(name: str) -> int:
    tail = name.removeprefix("step ").strip()
    return int(tail) if tail.isdigit() else 0


def render_metrics(metrics_jsonl: Path, out_png: Path, *, title: str | None = None) -> Path:
    """Loss and samples/s against the step, from metrics.jsonl."""
    try:
        lines = metrics_jsonl.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {str(metrics_jsonl)!r}: {exc.__class__.__name__}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{str(metrics_jsonl)!r} line {number} is not JSON") from None
    series = {key: [(r["step"], r[key]) for r in rows if isinstance(r, dict) and "step" in r
                    and isinstance(r.get(key), (int, float))]
              for key in ("loss", "samples_per_s")}
    if not any(series.values()):
        raise UserError(f"{str(metrics_jsonl)!r} holds no rows with step and loss or samples_per_s")
    fig = Figure(figsize=(11, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    labels = {"loss": "training loss (global batch)", "samples_per_s": "throughput (samples/s)"}
    for i, (key, points) in enumerate(series.items(), start=1):
        ax = fig.add_subplot(1, 2, i)
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) <= 30 else None, markersize=3,
                    color=COLORS["forward" if key == "loss" else "comm"])
        ax.set_xlabel("step")
        ax.set_title(labels[key], fontsize=10)
        ax.grid(color="#eeeeee")
    if title:
        fig.suptitle(title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png

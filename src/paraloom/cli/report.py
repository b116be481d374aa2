"""`paraloom report`: draw a traced run's timeline and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from paraloom.config.errors import UserError


def report(
    run_dir: Annotated[Path, typer.Argument(
        metavar="RUN_DIR", help="run directory written by `paraloom train --trace`")],
    out: Annotated[Path | None, typer.Option(
        metavar="PNG", help="timeline image (default: RUN_DIR/timeline.png)")] = None,
) -> None:
    """Draw a run's traced timeline (and its metrics, when logged) as PNG images."""
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise UserError(f"run directory {str(run_dir)!r} {what}; give runs/<name> from `paraloom train`")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{str(run_dir)!r} is not a run directory (no config.yaml); "
                        "give runs/<name> from `paraloom train`")
    traces = sorted((run_dir / "trace").glob("rank*.json"), key=_rank_of)
    if not traces:
        raise UserError(f"no trace in {run_dir}: train with --trace")
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    from paraloom.trace.plots import render_metrics, render_timeline

    print(render_timeline(traces, out or run_dir / "timeline.png", title=run_dir.name))
    if (run_dir / "metrics.jsonl").is_file():
        print(render_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png", title=run_dir.name))


def _rank_of(path: Path) -> tuple[int, str]:
    digits = path.stem.removeprefix("rank")
    return (int(digits) if digits.isdigit() else -1, path.name)

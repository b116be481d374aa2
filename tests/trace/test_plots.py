"""Rendering: timelines of synthetic ranks and metrics curves become PNG files."""

import json

import pytest

from paraloom.config.errors import UserError
from paraloom.trace import Timeline
from paraloom.trace.plots import load_spans, render_metrics, render_timeline


@pytest.mark.parametrize("ranks", [2, 8])
def test_timeline_png_for_synthetic_ranks(tmp_path, ranks, synthetic_trace, is_png):
    paths = [synthetic_trace(tmp_path, r) for r in range(ranks)]
    out = render_timeline(paths, tmp_path / "timeline.png", title="synthetic")
    assert out == tmp_path / "timeline.png" and is_png(out)


def test_ranks_line_up_on_the_wall_clock_and_max_steps_cuts(tmp_path, synthetic_trace, is_png):
    paths = [synthetic_trace(tmp_path, r) for r in range(2)]
    spans = load_spans(paths)
    assert {(s.rank, s.kind) for s in spans} >= {(0, "forward"), (1, "backward"), (1, "comm"), (0, "step")}
    first = {r: min(s.start_ms for s in spans if s.rank == r) for r in (0, 1)}
    assert first[1] - first[0] == pytest.approx(1.0)  # rank 1 started 1 ms later
    late = synthetic_trace(tmp_path, 1, origin_unix_s=1.7e9 + 0.010)  # its Timeline began 10 ms later
    spans = load_spans([paths[0], late])
    first = {r: min(s.start_ms for s in spans if s.rank == r) for r in (0, 1)}
    assert first[1] - first[0] == pytest.approx(11.0)
    out = render_timeline(paths, tmp_path / "one.png", max_steps=1)
    assert is_png(out)


def test_empty_or_broken_traces_are_user_errors(tmp_path):
    empty = Timeline(0).write(tmp_path / "rank0.json")
    with pytest.raises(UserError, match="at least 2 steps"):
        render_timeline([empty], tmp_path / "t.png")
    broken = tmp_path / "rank1.json"
    broken.write_text("{not json")
    with pytest.raises(UserError, match="cannot read trace file"):
        render_timeline([broken], tmp_path / "t.png")
    other = tmp_path / "rank2.json"
    other.write_text(json.dumps({"events": []}))
    with pytest.raises(UserError, match="not a Chrome trace"):
        render_timeline([other], tmp_path / "t.png")


def test_metrics_png(tmp_path, is_png):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "epoch": 0, "loss": 2.3 / s, "samples_per_s": 5000 + s})
                               + "\n" for s in range(10, 110, 10)))
    out = render_metrics(metrics, tmp_path / "metrics.png")
    assert is_png(out)
    metrics.write_text("")
    with pytest.raises(UserError, match="holds no rows"):
        render_metrics(metrics, tmp_path / "m.png")


def test_pipeline_and_tensor_parallel_spans_are_drawn_as_compute_and_communication(tmp_path):
    timeline = Timeline(0)
    timeline.active = True
    for name, lane in (("F0", "compute"), ("B12", "compute"), ("send F0 to stage 1", "p2p"),
                       ("all_reduce g forward", "tp"), ("Fancy", "compute"), ("step 2", "step")):
        timeline.span(name, lane, 0.0, 0.001)
    kinds = {s.name: s.kind for s in load_spans([timeline.write(tmp_path / "rank0.json")])}
    assert kinds == {"F0": "forward", "B12": "backward", "send F0 to stage 1": "comm",
                     "all_reduce g forward": "comm", "Fancy": "other", "step 2": "step"}

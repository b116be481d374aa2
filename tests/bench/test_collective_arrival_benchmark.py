"""benchmarks/collective_arrival.py --quick runs end to end: two ranks alternate compute and a tiny
all-reduce (or all-gather), and the report gives each part of a round's time."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(120)
def test_collective_arrival_quick(tmp_path):
    out = tmp_path / "arrival.json"
    run_script("collective_arrival.py", "--quick", "--kinds", "all_reduce", "all_gather", "--kb", "0.004",
               "--json", str(out), timeout=100)
    report = json.loads(out.read_text())
    (row,) = report["results"]["2"]
    assert row["segment_ms"] == 1.0 and row["alone_ms"] > 0.5  # a segment, as two ranks run it together
    assert row["isolated_ms"] > 0  # the all-reduce's own time, no compute between
    assert set(row["rounds"]) == {"alone", "with", "isolated"}
    assert all(len(rounds) == 1 for rounds in row["rounds"].values())
    # by kind: the table the model reads is the one-float all-reduce's; a gather of one float a rank too
    assert report["by_kind"]["all_reduce"]["4"]["2"] == [row]
    (gather,) = report["by_kind"]["all_gather"]["4"]["2"]
    assert gather["isolated_ms"] > 0 and set(gather["rounds"]) == {"alone", "with", "isolated"}

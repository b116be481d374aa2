"""benchmarks/compression_accuracy.py --quick runs end to end; its summary judges each mean against none's."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(240)
def test_compression_accuracy_benchmark_quick(tmp_path):
    out = tmp_path / "accuracy.json"
    run_script("compression_accuracy.py", "--quick", "--json", str(out), timeout=200)
    report = json.loads(out.read_text())
    rows = report["groups"]["adam"]
    assert set(rows) == {"none", "topk"} and report["seeds"] == [0]
    for row in rows.values():
        assert row["mean"] == row["per_seed"]["0"] > 0.3  # one epoch of digits; chance is 0.1
    drop = 100 * (rows["none"]["mean"] - rows["topk"]["mean"])
    summary = report["summary"]
    assert summary["acc_drop_pt"] == {"adam/topk": round(drop, 3)} and summary["worst"] == "adam/topk"
    assert summary["all_within_1pt"] == (drop <= 1.0)

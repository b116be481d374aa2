"""benchmarks/large_batch.py --quick runs end to end: the default batch and LAMB at 8x, judged against it."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(240)
def test_large_batch_benchmark_quick(tmp_path):
    out = tmp_path / "large_batch.json"
    run_script("large_batch.py", "--quick", "--json", str(out), timeout=200)
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"default", "lamb-8x"} and report["large_batch"] == 8 * report["base_batch"] == 512
    for row in runs.values():
        assert {"val_loss", "ratio_to_default", "steps", "wall_seconds", "lr", "effective_lr"} <= set(row)
    assert runs["lamb-8x"]["effective_lr"] == 8 * runs["lamb-8x"]["lr"]  # the linear scaling rule
    assert runs["default"]["steps"] > runs["lamb-8x"]["steps"] >= 1  # same epochs, 8x fewer steps
    summary = report["summary"]
    assert summary["ratio_to_default"]["default"] == 1.0
    assert summary["lamb_within_2pct"] == (summary["ratio_to_default"]["lamb-8x"] <= 1.02)
    assert 0 < runs["default"]["val_loss"] < report["unigram_loss"] + 2  # learned something in a few steps

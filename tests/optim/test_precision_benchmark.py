"""benchmarks/precision.py --quick runs end to end and reports every precision's figures."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(200)
def test_precision_benchmark_quick(tmp_path):
    out = tmp_path / "precision.json"
    run_script("precision.py", "--quick", "--json", str(out), timeout=180)
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"fp32", "bf16", "fp16"}
    assert {"bf16_gap_pt", "fp16_gap_pt"} <= set(report)
    assert len(report["runs"]["fp16"]["per_seed"]["0"]["loss_scale_per_rank"]) == 2

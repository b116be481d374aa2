"""benchmarks/sparsity.py --quick --loopback runs end to end and reports the issue's keys."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(480)
def test_sparsity_benchmark_quick(tmp_path):
    out = tmp_path / "sparsity.json"
    run_script("sparsity.py", "--quick", "--loopback", "--json", str(out), timeout=420)
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"acc_drop_pt_90", "wire_ratio_90", "step_ratio_90"}
    assert 0.05 < report["summary"]["wire_ratio_90"] < 0.15  # 10% of the weights, all of the biases
    assert abs(report["accuracy"]["0.9"]["sparsity"] - 0.9) < 0.01

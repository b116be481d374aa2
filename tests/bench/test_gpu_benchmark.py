"""benchmarks/gpu.py --quick --device cpu runs end to end: every figure of a device is there and sane."""

import json

import pytest
from scripts import run_script

from paraloom.compress import COMPRESSORS


@pytest.mark.timeout(240)
def test_gpu_benchmark_quick_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    run_script("gpu.py", "--quick", "--device", "cpu", "--json", str(out), timeout=200)
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and set(report["compute"]) == {"fp32", "bf16"}
    for row in report["compute"].values():
        assert set(row) == {"matmul", "conv", "attention", "other", "bandwidth"}
        assert all(value > 0 for value in row.values())
    (bucket, rates), = report["codecs"].items()
    assert bucket == "1MB" and set(rates) == set(COMPRESSORS) and all(r > 0 for r in rates.values())
    overhead = report["overhead"]
    assert set(overhead["step_seconds"]) == {"plain", "paraloom", "ddp"}
    assert all(len(rounds) == 2 for rounds in overhead["rounds"].values())
    assert overhead["paraloom_vs_plain"] == pytest.approx(
        overhead["step_seconds"]["paraloom"] / overhead["step_seconds"]["plain"])

"""benchmarks/gpu.py --quick --device cpu runs end to end: every figure of a device is there and sane."""

import json

import pytest
from scripts import run_script

from paraloom.compress import COMPRESSORS


@pytest.mark.timeout(240)
def test_gpu_benchmark_quick_on_cpu(tmp_path):
    out, traces = tmp_path / "gpu.json", tmp_path / "trace.txt"
    run_script("gpu.py", "--quick", "--device", "cpu", "--json", str(out), "--trace", str(traces),
               timeout=200)
    names = [line for line in traces.read_text().splitlines() if line.startswith("== ")]
    assert names[0] == "== case: tiny gpt b4 fp32"  # then the engine's variants, in the last round's order
    assert sorted(names[1:]) == ["== engine: ddp", "== engine: paraloom", "== engine: plain"]
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
    # the prediction used the profile this run measured, and every case was measured
    rows = report["prediction"]["rows"]
    assert [r["case"] for r in rows] == ["tiny gpt b4 fp32", "tiny gpt b8 bf16 recompute", "mlp b32 fp32"]
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 and r["measured_bytes"] is None for r in rows)
    for r in rows:  # the one step timed part by part after the measured ones
        assert set(r["measured_phases_s"]) == {"copy", "forward", "backward", "update"}
        assert all(seconds > 0 for seconds in r["measured_phases_s"].values())
    assert report["prediction"]["time_error_max"] == max(abs(r["time_error"]) for r in rows)
    assert report["profile"]["constants"]["launch_s"] == report["launch_s"] > 0

"""benchmarks/compile_overlap.py --quick runs end to end (inductor) and reports every placement."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(400)
def test_compile_overlap_benchmark_quick(tmp_path):
    out = tmp_path / "compile.json"
    run_script("compile_overlap.py", "--quick", "--json", str(out), timeout=360)
    report = json.loads(out.read_text())
    placements = report["placements"]
    assert set(placements) == {"eager", "compiled_inside", "compiled_outside"}
    for row in placements.values():
        assert row["step_s"] > 0 and 0.0 <= row["overlap_window"] <= 1.0 and row["buckets"] > 1

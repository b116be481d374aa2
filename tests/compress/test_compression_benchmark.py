"""benchmarks/compression.py --quick --loopback runs end to end and reports the issue's keys."""

import json
import subprocess
import sys

import pytest
from scripts import ROOT, run_script


@pytest.mark.timeout(480)
def test_compression_benchmark_quick(tmp_path):
    out = tmp_path / "compression.json"
    run_script("compression.py", "--quick", "--loopback", "--json", str(out), timeout=420)
    report = json.loads(out.read_text())
    assert {"best_tta_speedup_vs_ddp", "topk_wire_ratio", "topk_acc_drop_pt", "fp16_step_ratio"} <= set(
        report["summary"])
    variants = report["rows"]["loopback"]["variants"]
    assert abs(variants["fp16"]["wire_ratio"] - 2) < 0.01
    assert variants["topk_0.001"]["wire_ratio"] > 400  # values and indices of 0.1%, biases included
    assert variants["powersgd"]["wire_ratio"] > 1.5  # compressed after its first 10 steps
    for name, out in variants.items():
        assert len(out["curve"]) == 4, name  # two evaluations per epoch, two epochs
        assert out["curve"][-1][0] == out["steps"] and out["final_accuracy"] > 0.3, name  # chance is 0.1
    assert variants["ddp"]["codec_s_per_step"] == 0 and variants["qsgd"]["codec_s_per_step"] > 0


@pytest.mark.parametrize("args", [("--variants", "ddp,nope"), ("--rows", "10gbit")])
def test_compression_benchmark_refuses_unknown_rows_and_variants_in_one_line(tmp_path, args):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compression.py"), *args,
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out.json").exists()

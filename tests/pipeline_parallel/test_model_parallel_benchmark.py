"""benchmarks/model_parallel.py --quick runs end to end (paraloom, torch pipelining, DTensor) and reports."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(480)
def test_model_parallel_benchmark_quick(tmp_path):
    out = tmp_path / "mp.json"
    run_script("model_parallel.py", "--quick", "--json", str(out), timeout=420)
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert 0 < summary["tp4_param_mem_ratio"] < 0.3  # tp=4 holds about a quarter plus the replicated share
    assert summary["pp_vs_torch_pipelining"] > 0  # torch.distributed.pipelining ran beside paraloom
    assert "ratio" in report["tensor_vs_dtensor"]["tp2"], report["tensor_vs_dtensor"]  # DTensor ran
    assert summary["bubble_rel_error"] is not None
    tp4 = report["plans"]["tp4"]
    assert tp4["grid"] == {"dp": 1, "tp": 4, "pp": 1}
    assert len(set(tp4["param_bytes_per_rank"])) == 1  # heads, MLP and vocabulary split evenly
    inter = report["interleaving"]  # part (e): interleaved 1F1B's bubble beside 1F1B's, p = 2, m = 4
    assert inter["1f1b"]["bubble_theory"] == pytest.approx(1 / 5)
    assert inter["interleaved_1f1b"]["bubble_theory"] == pytest.approx(1 / 9)
    assert all(run["bubble_bottleneck"] >= 0 for run in inter["interleaved_1f1b"]["runs"])
    for run in inter["1f1b"]["runs"] + inter["interleaved_1f1b"]["runs"]:  # steady waits: a part of the idle
        assert 0 <= run["steady_wait_bottleneck"] <= run["bubble_bottleneck"]
        assert run["busier_over_lighter"] >= 1 and 0 < run["fill_drain_expected_bottleneck"] < 1
        assert run["bubble_fill_drain"] in run["bubble_fill_drain_per_rank"]  # the bottleneck's own
        assert run["fill_drain_lighter_stage"] in run["bubble_fill_drain_per_rank"]
        assert run["bubble_fill_drain_last_stage"] == run["bubble_fill_drain_per_rank"][-1]  # the headline
    assert "fill_drain_rel_error_at_measured_balance_interleaved_p2_m8_v2" in summary
    assert summary["fill_drain_rel_error_1f1b_p2_m8"] >= 0
    assert summary["last_stage_fill_drain_rel_error_interleaved_p2_m8_v2"] >= 0
    assert summary["step_ratio_interleaved_over_1f1b"] > 0

"""benchmarks/sharding.py --quick runs end to end: DDP, a bare fully_shard loop and paraloom take turns,
and the bytes each holds shrink with the sharding level as they must."""

import json

import pytest
from scripts import run_script


@pytest.mark.timeout(240)
def test_sharding_benchmark_quick(tmp_path):
    out = tmp_path / "sharding.json"
    run_script("sharding.py", "--quick", "--json", str(out), timeout=200)
    report = json.loads(out.read_text())
    held = report["held"]
    assert set(held) == {"ddp", "fully_shard", "paraloom_gradients", "paraloom_full",
                         "paraloom_full_no_prefetch", "paraloom_full_pp2", "paraloom_full_units"}
    # dp2 x pp2: rank 0's stage (about half the model) sharded over 2 ranks, also about a quarter at rest
    assert held["paraloom_full_pp2"]["n_params"] < held["ddp"]["n_params"]
    ddp = held["ddp"]
    assert ddp["optimizer"] == 2 * ddp["params"]  # AdamW's two moments
    assert ddp["peak_state"] >= ddp["total"]  # DDP holds its whole state throughout
    for name in ("fully_shard", "paraloom_full", "paraloom_gradients", "paraloom_full_no_prefetch",
                 "paraloom_full_units"):
        # a quarter of every tensor at dp4, up to the padding of rows that do not divide by 4
        assert held[name]["total"] == pytest.approx(ddp["total"] / 4, rel=0.05), name
        # units gathered and gradients reduced on top of the shards, never the whole model's state
        assert held[name]["total"] < held[name]["peak_state"] < ddp["peak_state"], name
    speed = report["speed"]["loopback_4"]
    assert all(len(rounds) == 2 for rounds in speed["seconds"].values())
    summary = report["summary"]
    assert summary["mem_ratio_full_at_rest_vs_ddp"] == pytest.approx(0.25, rel=0.05)
    assert summary["mem_ratio_full_at_rest_vs_ddp"] < summary["mem_ratio_full_vs_ddp"] \
        <= summary["mem_ratio_gradients_vs_ddp"]  # gradients keeps every unit gathered until backward
    # without explicit prefetch paraloom holds what the bare loop holds, buffers included
    assert summary["mem_ratio_no_prefetch_vs_fully_shard"] == pytest.approx(1.0, rel=0.01)
    assert 0.5 < summary["mem_ratio_vs_fully_shard"] < 1.5
    assert summary["step_ratio_vs_fully_shard_loopback"] > 0
    # the model's state at the peak beside the measured, variant by variant (the tiny model's units are
    # a larger share of it than the benchmark's: loosely)
    assert set(report["memory_model"]) == set(held)
    assert summary["model_memory_max_abs_err"] < 0.3
    assert summary["model_median_abs_err"] is None and summary["n_model_configs"] == 0  # needs root

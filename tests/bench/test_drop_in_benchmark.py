"""benchmarks/drop_in.py --quick runs end to end: DDP and the drop-in take turns, and without dropout
they train the same losses; the summary takes the worse cluster per figure."""

import importlib.util
import json

import pytest
from scripts import ROOT, run_script


@pytest.mark.timeout(240)
def test_drop_in_benchmark_quick(tmp_path):
    out = tmp_path / "drop_in.json"
    run_script("drop_in.py", "--quick", "--json", str(out), timeout=200)
    report = json.loads(out.read_text())
    cases = report["clusters"]["loopback_2"]
    assert set(cases) == {"eager", "eager_dropout", "eager_tied"}
    for row in cases.values():
        rounds = row["seconds"]
        assert len(rounds["ddp"]) == len(rounds["drop_in"]) == len(row["ratio_per_round"]) == 2
        assert row["ratio"] > 0
    assert cases["eager"]["max_loss_gap"] == 0.0  # the same arithmetic: bit-equal losses
    assert cases["eager_dropout"]["max_loss_gap"] is None


def test_summary_is_the_worse_cluster_per_figure(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports benchmarks/common.py
    spec = importlib.util.spec_from_file_location("drop_in_benchmark", ROOT / "benchmarks" / "drop_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    def cluster(**ratios):
        return {case: {"ratio": ratios.get(case, 1.0)} for case in module.CASES}

    summary = module.summarize({"a": cluster(eager=0.98, compiled_inside=1.03),
                         "b": cluster(eager=0.99, compiled_outside=0.9)})
    assert summary["eager_vs_ddp"] == 0.99 and summary["compiled_inside_vs_ddp"] == 1.03
    assert summary["compiled_outside_vs_ddp"] == 1.0 and summary["compiled_vs_ddp"] == 1.03
    assert summary["eager_dropout_vs_ddp"] == summary["eager_tied_vs_ddp"] == 1.0

"""benchmarks/perfmodel_validation.py predicts a stored quick run again (its measuring half needs root
and minutes; `--quick` is run by hand) and reports the issue's keys."""

import json
from pathlib import Path

from scripts import run_script

STORED = Path(__file__).parent / "data" / "validation_quick.json"  # a --quick run of 2026-11-23


def test_reanalysis_reports_the_issue_keys(tmp_path):
    out = tmp_path / "v.json"
    run_script("perfmodel_validation.py", "--reanalyze", str(STORED), "--json", str(out), timeout=100)
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"median_abs_err", "max_abs_err", "best_plan_hit_rate", "n_configs"}
    assert report["summary"]["n_configs"] == len(report["configs"]) == 2
    for c in report["configs"]:
        assert c["predicted_s"] > 0 and abs(c["rel_err"]) < 0.5, c  # the model is in the measurement's range
    group = report["groups"]["mlp 2w 1gbit"]  # a hit: the predicted fastest measured within 5% of the best
    measured = {c["name"]: c["measured_s"] for c in report["configs"]}
    assert group["predicted_fastest"] == min(report["configs"], key=lambda c: c["predicted_s"])["name"]
    assert group["hit"] == (measured[group["predicted_fastest"]] <= 1.05 * min(measured.values()))

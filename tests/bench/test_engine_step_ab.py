"""benchmarks/engine_step_ab.py end to end: the same tree as new and base, a few steps each."""

import json

from scripts import ROOT, run_script


def test_a_tree_against_itself_reports_a_ratio(tmp_path):
    out = tmp_path / "ab.json"
    run_script("engine_step_ab.py", "--new", str(ROOT), "--base", str(ROOT), "--pairs", "2", "--steps", "3",
               "--blocks", "1", "--json", str(out), timeout=120)
    report = json.loads(out.read_text())
    assert len(report["seconds"]["new"]) == len(report["seconds"]["base"]) == 2
    assert all(s > 0 for s in report["seconds"]["new"] + report["seconds"]["base"])
    assert report["ratio_new_over_base"] == report["median_new_s"] / report["median_base_s"]

"""benchmarks/common.py: every result file says which machine it ran on."""

import json

from scripts import ROOT


def test_a_report_records_the_machine_it_ran_on(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import common

    out = tmp_path / "report.json"
    common.write_json(out, {"summary": {"ratio": 0.9}})
    report = json.loads(out.read_text())
    assert report["summary"] == {"ratio": 0.9}
    assert report["machine"]["cpu"] and report["machine"]["cores"] >= 1
    assert report["machine"]["torch"].startswith("2.")
    common.write_json(out, {"machine": {"cpu": "given"}})  # a report that names its own machine keeps it
    assert json.loads(out.read_text())["machine"] == {"cpu": "given"}

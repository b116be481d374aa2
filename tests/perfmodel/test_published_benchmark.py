"""benchmarks/perfmodel_published.py predicts published cases from their setup alone and reports the
issue's keys; the case file holds what its checks need (citations, splits, the pending list)."""

import json
import subprocess
import sys

import pytest
import yaml
from scripts import ROOT, run_script

CASES = ROOT / "benchmarks" / "published_cases.yaml"


def test_the_case_file_cites_every_case_and_splits_it():
    data = yaml.safe_load(CASES.read_text())
    ids = [case["id"] for case in data["cases"]]
    assert len(ids) == len(set(ids))
    for case in data["cases"]:
        assert case["source"] in data["sources"] and case["split"] in ("fit", "heldout"), case["id"]
        assert case.get("where"), case["id"]  # the table, row or sentence it comes from
    heldout = [c for c in data["cases"] if c["split"] == "heldout"]
    assert len(heldout) >= 15 and len({c["source"] for c in heldout}) >= 4
    kinds = [c["kind"] for c in heldout]
    assert kinds.count("gpt-3d") >= 2 and kinds.count("cnn-scaling") >= 2 and "ps-scaling" in kinds
    assert all(item["why"] for item in data["pending"])


def test_a_few_cases_predicted_with_the_summary_keys(tmp_path):
    out = tmp_path / "p.json"
    chosen = ["megatron-t1-1.7B", "tf-dgx1-resnet50-8gpu", "goyal-resnet50-8to256", "korthikanti-t5-22B-full"]
    run_script("perfmodel_published.py", "--json", str(out), "--only", *chosen, timeout=120)
    report = json.loads(out.read_text())
    assert sorted(r["id"] for r in report["rows"]) == sorted(chosen)  # in the case file's order
    summary = report["summary"]
    for key in ("n_heldout", "heldout_within_15pct", "heldout_median_abs_err", "n_sources"):
        assert key in summary
    assert summary["n_sources"] == 4 and summary["n_heldout"] == 1
    for row in report["rows"]:
        assert row["predicted"] > 0 and row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
        assert abs(row["error"]) < 1.0, row  # the model is in the published figure's range


def test_a_bad_case_is_refused_in_one_line(tmp_path):
    bad = yaml.safe_load(CASES.read_text())
    bad["cases"] = [dict(bad["cases"][0], plan={"dp": 2, "warp": 3})]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perfmodel_published.py"), "--json",
                           str(tmp_path / "o.json"), "--cases", str(path)], capture_output=True, text=True)
    assert done.returncode == 2 and "plan fields ['warp'] are not known" in done.stderr


def test_a_framework_that_reduces_after_backward_exposes_the_all_reduce(tmp_path):
    """Megatron-LM all-reduces its gradient buffer after the last backward (FRAMEWORK_PLANS): the same
    case without the framework hides most of that all-reduce behind backward; a framework the
    benchmark does not know is refused in one line."""
    data = yaml.safe_load(CASES.read_text())
    case = next(c for c in data["cases"] if c["id"] == "megatron-t1-1.7B")
    assert case["framework"] == "megatron-lm"
    bare = {k: v for k, v in case.items() if k != "framework"}
    data["cases"] = [case, dict(bare, id="no-framework")]
    path, out = tmp_path / "cases.yaml", tmp_path / "o.json"
    path.write_text(yaml.safe_dump(data))
    run_script("perfmodel_published.py", "--json", str(out), "--cases", str(path), timeout=120)
    megatron, plain = json.loads(out.read_text())["rows"]
    assert megatron["step_s"] > plain["step_s"] * 1.1  # the 1.7B model's 0.6 s all-reduce, now exposed
    data["cases"] = [dict(case, framework="caffe")]
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perfmodel_published.py"), "--json",
                           str(out), "--cases", str(path)], capture_output=True, text=True)
    assert done.returncode == 2 and "framework 'caffe' is not known" in done.stderr


def _fit_back(tmp_path, case_id: str, hardware_at: dict, target: str) -> dict:
    """Predict the case on `hardware_at`, call that its measurement, then `--fit target` on the case as
    committed: the fit `--fit` reports."""
    data = yaml.safe_load(CASES.read_text())
    case = next(c for c in data["cases"] if c["id"] == case_id)
    path, out = tmp_path / "cases.yaml", tmp_path / "o.json"
    at = dict(case, hardware={**case["hardware"], **hardware_at})
    path.write_text(yaml.safe_dump({**data, "cases": [at]}))
    run_script("perfmodel_published.py", "--json", str(out), "--cases", str(path), timeout=120)
    predicted = json.loads(out.read_text())["rows"][0]["predicted"]
    measured = dict(case, measured={**case["measured"], "value": predicted})
    path.write_text(yaml.safe_dump({**data, "cases": [measured]}))
    run_script("perfmodel_published.py", "--json", str(out), "--cases", str(path), "--fit", target,
               timeout=120)
    (fit,) = json.loads(out.read_text())["fits"]
    return fit


def test_fit_recovers_the_efficiency_a_case_was_measured_at(tmp_path):
    """A fit case measured at exactly what the model predicts with conv at 0.3 fits back to 0.3."""
    k80_at = {"device": {"preset": "k80", "efficiency": {"conv": 0.3}}}
    fit = _fit_back(tmp_path, "tf-aws-resnet50-1gpu", k80_at, "k80.conv")
    assert (fit["device"], fit["op_class"], fit["value"]) == ("k80", "conv", 0.3)
    assert fit["median_after"] < 1e-9 < fit["median_before"] and fit["cases"] == ["tf-aws-resnet50-1gpu"]


def test_fit_recovers_the_winograd_factor_a_case_was_measured_at(tmp_path):
    """A P100 case measured at what the model predicts with a Winograd factor of 3 fits back to 3."""
    p100_at = {"device": {"preset": "p100", "winograd": {"fp32": 3.0}}}
    fit = _fit_back(tmp_path, "tf-dgx1-alexnet-1gpu", p100_at, "p100.winograd")
    assert (fit["device"], fit["op_class"], fit["value"]) == ("p100", "winograd", 3.0)
    assert fit["median_after"] < 1e-9 < fit["median_before"]


def test_megatrons_own_layout_of_its_1t_run_fits_its_80_gb_gpus(tmp_path):
    """Narayanan et al. 2021 trained the 1T GPT on tp8 x pp64 A100s of 80 GB: in Megatron's layout (the
    model in fp16, one fp32 main_grad) the model says it fits; in paraloom's own it would not."""
    out = tmp_path / "p.json"
    run_script("perfmodel_published.py", "--json", str(out), "--only", "megatron-t1-1008.0B", timeout=120)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fits"] and row["memory_gib"] < 80


def test_fit_recovers_a_frameworks_constant_from_its_fit_cases(tmp_path):
    """A TensorFlow case measured at what the model predicts with 100 us a kernel fits back to 1e-4."""
    fit = _fit_back(tmp_path, "tf-dgx1-resnet50-1gpu", {"constants": {"op_overhead_s": 1e-4}},
                    "tensorflow-1.op_overhead_s")
    assert fit["cases"] == ["tf-dgx1-resnet50-1gpu"]  # it runs on TensorFlow: framework: tensorflow-1
    assert fit["value"] == pytest.approx(1e-4) and fit["median_after"] < 1e-9

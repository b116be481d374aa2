"""The history of runs, and the grey and black boxes fitted to it, scored leave-one-out."""

import json
import os
import random
import subprocess
import sys

import pytest

from paraloom.config.errors import UserError
from paraloom.perfmodel.runs import fitted, history
from paraloom.perfmodel.runs.contract import TERMS


def run(compute, communication, measured, world=2, **config):
    terms = dict.fromkeys(TERMS, 0.0) | {"compute": compute, "communication": communication}
    return {"config": {"parallel": config}, "world_size": world, "measured": {"step": measured},
            "predicted": {"step_seconds": compute + communication, "terms": terms}}


def test_without_runs_the_grey_box_is_the_white_box():
    assert fitted.fit_grey([]) == dict.fromkeys(TERMS, 1.0)


def test_the_grey_box_learns_a_term_the_white_box_prices_too_low():
    rng = random.Random(0)
    runs = []
    for _ in range(30):  # compute really takes 1.5x what the profile says; the link is right
        c, m = rng.uniform(0.01, 0.1), rng.uniform(0.01, 0.1)
        runs.append(run(c, m, (1.5 * c + m) * rng.uniform(0.97, 1.03)))
    scales = fitted.fit_grey(runs)
    assert scales["compute"] == pytest.approx(1.5, abs=0.1)
    assert scales["communication"] == pytest.approx(1, abs=0.1)
    assert scales["update"] == pytest.approx(1.0)  # no run has the term: the ridge keeps it where it was
    scores = fitted.leave_one_out(runs)
    assert scores["n"] == 30 and scores["white"]["median_abs_err"] > 0.1
    assert scores["grey"]["median_abs_err"] < 0.05 and scores["black"]["median_abs_err"] < 0.1


def test_the_black_box_fits_what_the_configuration_adds():
    rng = random.Random(1)
    runs = []
    for _ in range(40):  # tensor parallelism doubles the step, whatever the white box said
        tp = rng.choice([1, 2])
        c = rng.uniform(0.01, 0.1)
        runs.append(run(c, 0.0, c * (2 if tp == 2 else 1) * rng.uniform(0.98, 1.02), tp=tp))
    scores = fitted.leave_one_out(runs)
    assert scores["black"]["median_abs_err"] < 0.05 < scores["white"]["median_abs_err"]
    assert fitted.leave_one_out(runs[:1])["black"] is None  # one run: nothing to fit the others from


def test_history_lines_append_whole_and_a_torn_one_is_passed_over(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path))
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text("{}")
    (done / "config.yaml").write_text("{}")
    summary = {"world_size": 2, "contract": {"predicted": {"step_seconds": 0.01, "terms": {}},
                                             "measured": {"step": 0.02}}}
    history.record(done, {"model": {"name": "mlp"}}, summary)
    with open(history.history_path(), "a") as f:
        f.write('{"torn": \n')
    history.record(tmp_path / "gone", {}, {"contract": {"predicted": {"skipped": "none"}}})
    runs = history.read()
    assert [r["run_dir"] for r in runs] == [str(done), str(tmp_path / "gone")]
    assert runs[0]["predicted"]["step_seconds"] == 0.01 and runs[1]["predicted"] is None
    assert history.finished_run_dirs(runs) == [done]


def test_calibrate_from_history_reads_the_runs_still_on_disk(tmp_path, monkeypatch):
    from paraloom.cli.perf import _run_dirs

    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="lists no run directory"):
        _run_dirs([tmp_path / "x", "history"])
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for f in ("summary.json", "config.yaml"):
            (tmp_path / name / f).write_text("{}")
        history.record(tmp_path / name, {}, {})
    assert _run_dirs(["history", tmp_path / "c"]) == [tmp_path / "a", tmp_path / "b", tmp_path / "c"]


def test_the_history_command_lists_runs_and_scores_the_boxes(tmp_path):
    lines = [dict(run(0.01 * i, 0.005, 0.02 * i), date="2026-11-26T00:00:00", run_dir=str(tmp_path / f"r{i}"))
             for i in range(1, 6)]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = dict(os.environ, PARALOOM_CACHE_DIR=str(tmp_path), COLUMNS="150")
    done = subprocess.run([sys.executable, "-m", "paraloom", "history", "--json", str(tmp_path / "h.json")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "5 runs in" in done.stdout and "r5" in done.stdout
    assert "white: leave-one-out median error" in done.stdout and "black:" in done.stdout
    assert json.loads((tmp_path / "h.json").read_text())["leave_one_out"]["n"] == 5

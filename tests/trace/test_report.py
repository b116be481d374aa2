"""`paraloom train --trace` writes a trace on every rank; `paraloom report` draws it."""

import json
import subprocess
import sys

import pytest
import torch
from distributed import run_workers

from paraloom.cli import main
from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.run.directory import new_run_dir


def _one_error_line(capsys, message):
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("paraloom: error: ") and message in lines[0]


def test_report_on_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "runs/absent"]) == 2
    _one_error_line(capsys, "run directory 'runs/absent' does not exist")
    (tmp_path / "plain").mkdir()
    assert main(["report", "plain"]) == 2
    _one_error_line(capsys, "'plain' is not a run directory (no config.yaml)")
    run_dir = new_run_dir(load_config(), tmp_path / "runs" / "x")
    assert main(["report", "runs/x"]) == 2
    _one_error_line(capsys, "no trace in runs/x: train with --trace")
    assert not (run_dir / "timeline.png").exists()


def test_report_writes_timeline_and_metrics(tmp_path, capsys, synthetic_trace, is_png):
    run_dir = new_run_dir(load_config(), tmp_path / "r")
    for rank in range(2):
        synthetic_trace(run_dir, rank)
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.split() == [str(run_dir / "timeline.png")]
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 1.0, "samples_per_s": 9.0}) + "\n")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "t.png")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "t.png"), str(run_dir / "metrics.png")]
    for png in (run_dir / "timeline.png", tmp_path / "t.png", run_dir / "metrics.png"):
        assert is_png(png, min_bytes=100)


def test_trace_config_keys(capsys):
    assert load_config(overrides=["run.trace=true"]).run.trace_steps == 5
    with pytest.raises(UserError, match="run.trace_steps=0 must be at least 1"):
        load_config(overrides=["run.trace_steps=0"])
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--trace" in out and "trace_steps" in out and "steps traced, starting at the second step" in out


def _train_traced(rank, world, run_dir, cfg):
    from paraloom.train import train

    # as under torchrun: only global rank 0 is told the run directory
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


def test_every_rank_writes_its_trace_when_only_rank_0_knows_the_run_dir(tmp_path):
    cfg = load_config(overrides=["model.name=mlp", "optim.max_steps=4", "run.trace=true",
                                 "run.trace_steps=2", "run.save_model=false"])
    run_dir = new_run_dir(cfg, tmp_path / "w")
    summaries = run_workers(_train_traced, 2, run_dir, cfg)
    assert {s["trace_dir"] for s in summaries} == {str((run_dir / "trace").resolve())}
    for rank in range(2):
        doc = json.loads((run_dir / "trace" / f"rank{rank}.json").read_text())
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert [e["name"] for e in spans if e["cat"] == "step"] == ["step 2", "step 3"]
        compute = [e["name"] for e in spans if e["cat"] == "compute"]
        assert compute == (["forward 1", "forward 3", "forward 5", "backward 5", "backward 3", "backward 1"]
                           * 2)  # steps 2 and 3 only: not step 1, 4 nor the evaluation


def test_train_with_trace_then_report_end_to_end(tmp_path, is_png):
    proc = subprocess.run(
        [sys.executable, "-m", "paraloom", "train", "--nproc", "2", "--trace", "--set", "optim.max_steps=4",
         "--set", "model.name=mlp", "--set", "run.name=traced", "--set", f"run.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "traced"
    for rank in range(2):
        doc = json.loads((run_dir / "trace" / f"rank{rank}.json").read_text())
        assert doc["otherData"]["rank"] == rank
        assert any(e["ph"] == "X" and e["cat"] == "compute" for e in doc["traceEvents"])
    assert json.loads((run_dir / "summary.json").read_text())["trace_dir"] == str(run_dir / "trace")
    assert main(["report", str(run_dir)]) == 0
    assert is_png(run_dir / "timeline.png") and is_png(run_dir / "metrics.png")

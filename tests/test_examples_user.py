"""examples/user_digits.py and examples/user_text.py: a user's own model and data set, each named by
its YAML config, trained through the real `paraloom train` command with examples/ on PYTHONPATH.

The text model runs under data, tensor and pipeline parallelism; the three runs start from the same
seed and see the same batches, so they must agree on the loss (equivalence, not just "it ran").
Each run starts three Python processes (launcher and two workers), ~25 CPU-seconds, most of them
importing torch: the module takes ~110 CPU-seconds, about a minute on 2 idle cores.
"""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.testing import assert_close

from paraloom.cli import main
from paraloom.pipeline_parallel.partition import model_pieces
from paraloom.tensor_parallel import check_tp_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUNS = {  # name: (config, steps, settings)
    "digits_dp2": ("user_digits.yaml", 40, []),
    "text_dp2": ("user_text.yaml", 6, []),
    "text_tp2": ("user_text.yaml", 6, ["parallel.tp=2"]),
    "text_pp2": ("user_text.yaml", 6, ["parallel.pp=2"]),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """run name -> its run directory, each run trained once (on first use) for the whole module."""
    out_dir, done = tmp_path_factory.mktemp("user_examples"), {}

    def train(name):
        if name not in done:
            config, steps, settings = RUNS[name]
            sets = [f"optim.max_steps={steps}", "run.log_every=2", f"run.name={name}",
                    f"run.out_dir={out_dir}", *settings]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES),
                                                                            os.environ.get("PYTHONPATH")]))}
            cmd = [sys.executable, "-m", "paraloom", "train", str(EXAMPLES / config), "--nproc", "2"]
            proc = subprocess.run(cmd + [arg for s in sets for arg in ("--set", s)], capture_output=True,
                                  text=True, timeout=180, env=env, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[name] = out_dir / name
        return done[name]

    return train


@pytest.mark.parametrize("name", list(RUNS))
def test_example_trains_through_the_cli(trained, name, monkeypatch):
    run_dir = trained(name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == RUNS[name][1]
    assert summary["world_size"] == 2 and summary["restarts"] == 0 and summary["skipped_steps"] == 0
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["val_loss"])
    if name.startswith("digits"):  # 40 steps (under 2 epochs): well past chance (0.1), on the way to 0.98
        assert summary["test_accuracy"] > 0.85, summary
    else:  # next-byte loss: from ln(256) = 5.55 at the start, below 4.5 after 6 steps
        assert summary["val_loss"] < 4.5 and summary["test_accuracy"] > 0.1, summary
    if name.endswith(("tp2", "pp2")):
        assert summary["grid"] == {"dp": 1, "tp": 2 if "tp2" in name else 1, "pp": 2 if "pp2" in name else 1}
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the saved model is whole: it loads into the factory's
    example = importlib.import_module(RUNS[name][0].removesuffix(".yaml"))
    example.make_model().load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))


def test_text_model_trains_alike_under_dp_tp_and_pp(trained):
    runs = {name: json.loads((trained(name) / "summary.json").read_text())
            for name in ("text_dp2", "text_tp2", "text_pp2")}
    for name in ("text_tp2", "text_pp2"):
        for key in ("final_loss", "val_loss", "test_accuracy"):
            assert_close(runs[name][key], runs["text_dp2"][key], rtol=1e-3, atol=1e-4,
                         msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


def test_text_plan_in_yaml_is_the_models_and_fits_its_pieces(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import user_text

    config = yaml.safe_load((EXAMPLES / "user_text.yaml").read_text())
    assert config["model"]["tp_plan"] == user_text.TinyTransformer.tp_plan
    with torch.device("meta"):
        model = user_text.make_model(**config["model"]["options"])
    for tp in (2, 4):
        check_tp_plan(model, user_text.TP_PLAN, tp)
    assert len(model_pieces(model)) == config["model"]["options"]["n_layers"] + 2


def test_bad_factory_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES)}
    proc = subprocess.run([sys.executable, "-m", "paraloom", "train", str(EXAMPLES / "user_digits.yaml"),
                           "--set", "model.name=user_digits:nope", "--set", f"run.out_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: model.name='user_digits:nope'"), lines
    assert not any(tmp_path.iterdir())  # refused before a run directory is made


def test_data_factory_that_does_not_import_is_one_line(capsys, tmp_path):
    """In process (no PYTHONPATH for examples/ here): what the command's entry point returns."""
    assert main(["train", str(EXAMPLES / "user_text.yaml"), "--set", "data.name=user_nothing:make_data",
                 "--set", f"run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'user_nothing'" in err and "PYTHONPATH" in err, err

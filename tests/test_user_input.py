"""A user's factories, plan and optimizer, refused in one line with exit 2 before any worker starts."""

import pytest

from paraloom.cli import main

USER_CODE = '''
import torch
from torch import nn
from paraloom.data import DataSets


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i % 2


def make_model(width=8):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def make_data():
    return DataSets(Rows(), Rows(), n_classes=2)


def make_int():
    return 3


def make_raises():
    raise FileNotFoundError("weights.pt is missing")


def make_model_as_data():
    return make_model()
'''

OWN = ["--set", "model.name=plm_own:make_model", "--set", "data.name=plm_own:make_data",
       "--set", "data.batch_size=8"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "model.name=plm_absent_pkg.models:make"], "cannot import 'plm_absent_pkg.models'"),
    (["--set", "model.name=plm_own:nope"], "'plm_own' has no attribute 'nope'"),
    ([*OWN, "--set", "model.name=plm_own:make_raises"],
     "model.name='plm_own:make_raises': the factory raised FileNotFoundError: weights.pt is missing"),
    ([*OWN, "--set", "model.name=plm_own:make_int"], "must return a torch.nn.Module, not int"),
    ([*OWN, "--set", "data.name=plm_own:make_model_as_data"], "the factory returned type Sequential"),
    ([*OWN, "--set", "data.name=plm_own:make_raises"], "data.name='plm_own:make_raises': the factory raised"),
    ([*OWN, "--set", "model.options.depth=3"], "the factory takes no option 'depth'; it takes: width"),
    ([*OWN, "--set", "data.options.size=3"], "the factory takes no option 'size'; it takes: none"),
    ([*OWN, "--set", "parallel.tp=2", "--set", "model.tp_plan.head=colwise"],  # (a dotted pattern: YAML)
     "tp_plan pattern 'head' matches no module of the model; its modules include: 0, 2"),
    ([*OWN, "--set", "parallel.tp=2", "--set", "model.tp_plan.0=colwise", "--set", "model.options.width=7"],
     "does not divide"),
    ([*OWN, "--set", "parallel.tp=2"], "needs a tensor-parallel plan"),
    ([*OWN, "--set", "parallel.pp=2", "--set", "parallel.microbatches=2", "--set", "parallel.nproc=4",
      "--set", "model.name=plm_own:make_data"], "must return a torch.nn.Module"),
    (["--set", "model.options.widht=3"], "model.options widht: model.name=cnn does not take it; it takes: "
                                         "channels, hidden"),
    ([*OWN, "--set", "optim.name=adamx"], "optim.name='adamx' is not a torch.optim optimizer"),
    ([*OWN, "--set", "optim.name=adamw", "--set", "optim.options.betaz=1"],
     "optim.options betaz: AdamW does not take it"),
    ([*OWN, "--set", "optim.no_decay=*.bais"],
     "optim.no_decay '*.bais' matches no parameter of model.name=plm_own:make_model (its parameters are "
     "named like 0.weight, 0.bias, 2.weight, 2.bias)"),
    ([*OWN, "--set", "optim.no_decay=1d", "--set", "optim.name=rprop"],
     "optim.no_decay exempts parameters from weight decay; optim.name=rprop takes no weight_decay"),
    ([*OWN, "--set", "optim.no_decay=1d", "--set", "parallel.mode=ps"],
     "the parameter_server strategy does not take optim.no_decay"),
    ([*OWN, "--set", "optim.no_decay=1d", "--set", "comm.shard_optimizer=true"],
     "comm.shard_optimizer=true steps flat shards with one"),
    ([*OWN, "--set", "optim.no_decay= , "], "optim.no_decay names no parameter"),
])
def test_bad_user_code_is_one_line_and_exit_2_before_any_worker(argv, message, capsys, tmp_path, monkeypatch):
    (tmp_path / "plm_own.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: ") and message in lines[0], err
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_a_run_of_user_factories_is_named_without_colons():
    from paraloom.config import load_config
    from paraloom.run.directory import default_name

    name = default_name(load_config(None, ["model.name=pkg.models:make", "data.name=data:make"]), 2)
    assert name.startswith("pkg.models.make-data.make-dp2-") and ":" not in name

"""Mistakes only a built model, a real batch or the data's size show, refused before any worker starts.

Each case is a user's factory (written below into a module of the test's own) or a setting that
a config alone cannot check; each must end in exit code 2 and one line that names the setting and
what to do, with no traceback and no run directory (nothing was launched).
"""

import hashlib
import json

import pytest

from paraloom.cli import main

USER_CODE = '''
import torch
from torch import nn
from paraloom.data import DataSets


class Rows(torch.utils.data.Dataset):
    """n samples of `width` features, targets i % classes + shift; the last one a feature longer
    when `ragged`."""

    def __init__(self, width=16, classes=2, shift=0, ragged=False, n=16):
        self.width, self.classes, self.shift, self.ragged, self.n = width, classes, shift, ragged, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        width = self.width + (self.ragged and i == self.n - 1)
        return torch.full((width,), float(i)), i % self.classes + self.shift


class OneTooMany(torch.utils.data.Dataset):
    """A list of rows whose __len__ counts one more than it holds."""

    def __init__(self):
        self.rows = [(torch.zeros(16), 0)] * 16

    def __len__(self):
        return len(self.rows) + 1

    def __getitem__(self, i):
        return self.rows[i]


class OwnLoss(nn.Module):
    """Returns each sample's loss, not the batch's mean."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 2)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(x), y, reduction="none")


def make_model(width=16, classes=2, dtype="float32"):
    return nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, classes)).to(getattr(torch, dtype))


def make_pretrained(path="weights.pt"):
    model = make_model()
    if not next(model.parameters()).is_meta:  # on meta: shapes only, nothing to load
        model.load_state_dict(torch.load(path))
    return model


class CudaOnly(nn.Module):
    """Calls an operation this CPU has no kernel for (as a CUDA extension's would)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 2)

    def forward(self, x):
        raise NotImplementedError("Could not run 'ext::fused_op' with arguments from the 'CPU' backend")


def make_cuda_only():
    return CudaOnly()


def make_own_loss():
    return OwnLoss()


def make_data(declared=None, loss="classification", **rows):
    return DataSets(Rows(**rows), Rows(), loss=loss, n_classes=declared)


def make_short_data():
    return DataSets(OneTooMany(), Rows())
'''

OWN = ["--set", "model.name=plm_pre:make_model", "--set", "data.name=plm_pre:make_data",
       "--set", "data.batch_size=8"]


def own(*sets: str) -> list[str]:
    return [*OWN, *(arg for s in sets for arg in ("--set", s))]


CASES = [  # (arguments after `paraloom train`, the line's expected fragment)
    (own("model.options.dtype=float64"),
     "model.name=plm_pre:make_model's parameters are torch.float64 but data.name=plm_pre:make_data's batches "
     "are torch.float32: give them one dtype"),
    (own("model.options.dtype=float16"), "parameters are torch.float16 but data.name"),
    (own("data.options.width=17"),
     "model.name=plm_pre:make_model failed on a batch of data.name=plm_pre:make_data's training samples "
     "(input (2, 17) torch.float32) in its module '0' (Linear): RuntimeError: mat1 and mat2 shapes cannot "
     "be multiplied (2x17 and 16x8)"),
    (own("data.options.ragged=true"),
     "data.name=plm_pre:make_data's training samples differ in shape (sample 0: ((16,), 'int'), sample 15: "
     "((17,), 'int')), so they cannot be stacked into a batch"),
    (own("data.options.shift=5"),
     "data.name=plm_pre:make_data's training targets run from 5 to 6 but model.name=plm_pre:make_model's "
     "output has 2 classes (its last dimension): targets must lie in 0..1"),
    (own("data.options.declared=3", "data.options.classes=3"),
     "data.name=plm_pre:make_data has 3 classes (its n_classes) but model.name=plm_pre:make_model's output "
     "has 2"),
    (own("data.name=plm_pre:make_short_data"),
     "data.name=plm_pre:make_short_data's training set raised on sample 16 (of the 17 its __len__ gives): "
     "IndexError: list index out of range; fix its __getitem__"),
    (own("model.name=plm_pre:make_pretrained"),
     "model.name='plm_pre:make_pretrained': the factory raised FileNotFoundError"),
    (own("model.name=plm_pre:make_own_loss", "data.options.loss=model"),
     "model.name=plm_pre:make_own_loss returns its own loss (data.name=plm_pre:make_data's loss='model') but "
     "returned (2,) torch.float32: return the batch's mean loss"),
    (own("data.batch_size=32"),
     "data.batch_size=32 exceeds the 16 samples of data.name=plm_pre:make_data's training set: choose at "
     "most 16"),
    (["--set", "data.batch_size=1500"],
     "data.batch_size=1500 exceeds the 1438 samples of data.name=digits's training set: choose at most 1438"),
    (["--set", "model.name=gpt", "--set", "data.name=text", "--set", "data.seq_len=4096",
      "--set", "data.text_bytes=4000"],
     "the text corpus holds 4000 training bytes, too few for one sample of data.seq_len=4096: lower "
     "data.seq_len or raise data.text_bytes above it"),
    (["--set", "model.name=mlp", "--set", "model.hidden=1000000"],
     "model.name=mlp has 1,000,076,000,010 parameters (torch.float32): about 14,902.3 GiB per replica "
     "with its gradients and optimizer state (4 x its bytes), 29,804.6 GiB for 2 replica(s), but this "
     "machine has"),
    (["--set", "comm.timeout_s=1e300"], "comm.timeout_s=1e+300 must lie between 1 s and 604800 s (7 days)"),
    (["--set", "comm.timeout_s=1e-6"], "comm.timeout_s=1e-06 must lie between 1 s and 604800 s"),
    (["--set", "run.seed=100000000000000000000000"], "run.seed=100000000000000000000000 must lie between 0 "
                                                      "and 2**63-1"),
]


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "plm_pre.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)


def _sets(argv: list[str]) -> list[str]:
    """The values of an argument list of `--set` options, as load_config takes them."""
    return argv[1::2]


def _refused(argv, capsys, tmp_path):
    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: "), err
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was launched
    return lines[0]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[m[:40] for _, m in CASES])
def test_a_mistake_is_one_line_and_exit_2_before_any_worker(argv, message, user_code, capsys, tmp_path):
    line = _refused(argv, capsys, tmp_path)
    assert message in line, line


@pytest.mark.parametrize(("field", "value"), [("world_size", "two"), ("step", -3), ("grid", [2, "x"]),
                                              ("dp_size", 1.5)])
def test_a_resume_from_an_edited_manifest_names_the_file_and_field(field, value, capsys, tmp_path,
                                                                   monkeypatch):
    from paraloom.config import dump_config, load_config
    from paraloom.train.checkpoint.store import MANIFEST, step_dir

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "earlier"
    folder = step_dir(run, 30)
    folder.mkdir(parents=True)
    dump_config(load_config(None, []), run / "config.yaml")
    (folder / "objects-rank0.pt").write_bytes(b"x")
    files = {"objects-rank0.pt": {"sha256": hashlib.sha256(b"x").hexdigest(), "bytes": 1}}  # whole
    manifest = {"step": 30, "world_size": 2, "format": "dcp", "grid": None, "samples": 0,
                "global_batch": 64, "dp_size": 2, field: value, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    line = _refused(["--resume", str(run)], capsys, tmp_path)
    assert f"checkpoint manifest {folder / MANIFEST}: {field}={value!r} must be" in line, line


def test_factories_that_fit_pass_with_their_data(user_code):
    from paraloom.config import load_config
    from paraloom.run.preflight import preflight

    data = preflight(load_config(None, _sets(OWN)), 2)
    assert len(data.train) == 16


def test_a_model_too_big_to_build_here_runs_its_batch_on_meta(user_code, capsys, tmp_path, monkeypatch):
    """Above REAL_LIMIT parameters the model is not built for real: shapes still fail, on meta, and a
    factory that loads weights only off meta is not called there."""
    from paraloom.config import load_config
    from paraloom.run.preflight import preflight

    monkeypatch.setattr("paraloom.run.batch_check.REAL_LIMIT", 1)
    line = _refused(own("data.options.width=17"), capsys, tmp_path)
    assert "(input (2, 17) torch.float32) in its module '0' (Linear): RuntimeError:" in line, line
    preflight(load_config(None, _sets(own("model.name=plm_pre:make_pretrained"))), 2)


def test_an_operation_this_cpu_lacks_is_refused_only_where_the_workers_train_on_it(user_code, capsys,
                                                                                   tmp_path):
    from paraloom.config import load_config
    from paraloom.data import load_data
    from paraloom.models.make import make_model
    from paraloom.run.batch_check import check_batch

    line = _refused(own("model.name=plm_pre:make_cuda_only"), capsys, tmp_path)
    assert "in its forward: NotImplementedError: Could not run 'ext::fused_op'" in line, line
    cfg = load_config(None, _sets(own("model.name=plm_pre:make_cuda_only")))
    data = load_data(cfg)
    check_batch(cfg, data, make_model(cfg, data), on_gpus=True)  # the GPUs may have the kernel

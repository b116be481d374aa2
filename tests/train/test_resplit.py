"""A model-parallel checkpoint resumes on another grid: the model loads bitwise as saved, and the
next steps' losses and parameters are those of the run that kept its grid."""

import json
import shutil

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.train import train
from paraloom.train.checkpoint.store import step_dir

# SGD with momentum (its buffers are split and joined too): Adam would turn the float noise of
# gradients that are zero in exact arithmetic (attention's key bias) into steps of the full rate
GPT = [
    "model.name=gpt",
    "data.name=text",
    "data.seq_len=16",
    "data.text_bytes=4000",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=2",
    "data.batch_size=8",
    "optim.name=sgd",
    "optim.lr=0.1",
    "optim.max_steps=10",
    "run.checkpoint_every=5",
    "run.log_every=1",
    "run.save_model=true",
]


def _run(rank, world, settings, run_dir):
    cfg = load_config(None, [*GPT, *settings])
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r.get("loss") is not None}


def _from(straight, step, out):
    out.mkdir()
    shutil.copytree(step_dir(straight, step), step_dir(out, step))
    return out


MB = "parallel.microbatches=2"


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((4, ["parallel.pp=2", MB]), (4, ["parallel.pp=4", MB])),
        ((4, ["parallel.tp=2", "parallel.pp=2", MB]), (4, ["parallel.pp=2", MB])),
        ((2, ["parallel.tp=2"]), (1, [])),  # tensor parallel onto one data-parallel process
    ],
    ids=["dp2xpp2-to-pp4", "tp2xpp2-to-dp2xpp2", "tp2-to-tp1"],
)
def test_a_model_parallel_checkpoint_goes_on_on_another_grid(saved, resumed, tmp_path, capfd):
    (saved_world, saved), (world, resumed) = saved, resumed
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_run, saved_world, saved, straight, timeout=180)
    expected = torch.load(straight / "model.pt", weights_only=True)
    # loaded as saved: a run resumed at its last step takes no step, and its gathered model is the saved one
    at_end = _from(straight, 10, tmp_path / "at_end")
    run_workers(_run, world, resumed, at_end, timeout=180)
    got = torch.load(at_end / "model.pt", weights_only=True)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    # and it trains on as the saved grid did
    again = _from(straight, 5, tmp_path / "again")
    run_workers(_run, world, resumed, again, timeout=180)
    got = torch.load(again / "model.pt", weights_only=True)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
    before, after = _losses(straight), _losses(again)
    assert sorted(after) == list(range(6, 11))
    torch.testing.assert_close(
        torch.tensor([after[s] for s in after]),
        torch.tensor([before[s] for s in after]),
        rtol=1e-4,
        atol=1e-5,
    )
    assert f"saved by {saved_world} ranks, resumed on {world}" in capfd.readouterr().err


def _run_or_refuse(rank, world, settings, run_dir):
    from paraloom.config.errors import UserError

    try:
        _run(rank, world, settings, run_dir)
    except UserError as exc:
        return str(exc)
    return None


def test_two_parameter_groups_resume_on_their_own_grid_only(tmp_path):
    """optim.no_decay gives the optimizer two groups, whose state a resplit does not cut: the
    checkpoint resumes on its grid and is refused on another, in one line, not half-loaded."""
    groups = ["optim.no_decay=1d", "optim.weight_decay=0.01", "optim.max_steps=5"]
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_run, 2, ["parallel.tp=2", *groups], straight, timeout=180)
    same = _from(straight, 5, tmp_path / "same")
    assert run_workers(_run_or_refuse, 2, ["parallel.tp=2", *groups], same, timeout=180) == [None, None]
    for world, grid in ((2, ["parallel.pp=2", MB]), (1, [])):  # another grid; data parallelism
        copy = _from(straight, 5, tmp_path / f"world{world}")
        refusals = run_workers(_run_or_refuse, world, [*grid, *groups], copy, timeout=180)
        assert all(r is not None and "resume" in r and "grid" in r for r in refusals), refusals

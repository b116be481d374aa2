"""The loop's checkpoint component: a resume with nothing left to train is one line, on every rank."""

import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.train import train

SMALL = ["model.name=mlp", "model.hidden=8", "run.save_model=false", "run.log_every=2"]


def _steps_or_refusal(rank, world, overrides, run_dir):
    cfg = load_config(None, SMALL + overrides)
    try:
        summary = train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))
    except UserError as exc:
        return str(exc)
    return summary["steps"] if rank == 0 else None


def test_a_checkpoint_at_or_past_the_last_step_is_refused_unless_the_run_never_reported(tmp_path):
    """Once "resuming from checkpoint step 4 of 3" and a run that trained nothing, its summary written
    again; a run stopped after its last checkpoint, before reporting, still goes on to report."""
    assert run_workers(_steps_or_refusal, 2, ["optim.max_steps=4"], tmp_path) == [4, None]
    past, on_rank_1 = run_workers(_steps_or_refusal, 2, ["optim.max_steps=3"], tmp_path)
    assert past == on_rank_1
    assert past.startswith(f"nothing is left to train: the checkpoint of step 4 in {tmp_path} is past this "
                           "run's last step, 3 (optim.epochs=")
    assert past.endswith(", optim.max_steps=3); to train on, raise optim.max_steps above 4 with --set: "
                         f"paraloom train --resume {tmp_path} --set optim.max_steps=...")
    finished, on_rank_1 = run_workers(_steps_or_refusal, 2, ["optim.max_steps=4"], tmp_path)
    assert finished == on_rank_1 and f"the run in {tmp_path} finished at its last step, 4" in finished
    (tmp_path / "summary.json").unlink()  # stopped before it reported
    assert run_workers(_steps_or_refusal, 2, ["optim.max_steps=4"], tmp_path) == [4, None]
    assert (tmp_path / "summary.json").is_file()

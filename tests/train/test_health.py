"""Online straggler attribution: who lags its peers, by which term, after how many checks; live runs."""

import json

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.train import train
from paraloom.train.health import CHECKS, Health, lagging


def row(compute=0.010, data=0.001, communication=0.002, step=0.013, key=0):
    return {"key": key, "compute": compute, "data": data, "communication": communication, "step": step}


def test_a_rank_whose_compute_or_input_lags_its_peers_is_named_with_that_term():
    clean = [row(compute=0.010 * (1 + 0.05 * i)) for i in range(4)]  # 15% apart: noise, not a straggler
    assert lagging(clean) == {}
    slow = [row(), row(), row(compute=0.020, communication=0.0), row()]
    slow[0]["communication"] = slow[1]["communication"] = slow[3]["communication"] = 0.012  # they wait for it
    assert lagging(slow) == {2: ("compute", pytest.approx(10 / 13))}
    fed_late = [row(), row(data=0.011, communication=0.0), row(), row()]
    assert lagging(fed_late) == {1: ("input", pytest.approx(10 / 13))}


def test_the_peer_of_a_slow_rank_is_not_blamed_for_waiting_on_it():
    pair = [row(compute=0.020, communication=0.0), row(communication=0.012)]  # two replicas of a stage
    assert lagging(pair) == {0: ("compute", pytest.approx(10 / 13))}


def test_a_link_is_named_only_where_no_rank_lags_in_its_own_time():
    rows = [row(), row(communication=0.010), row(), row()]
    assert lagging(rows) == {1: ("link", pytest.approx(8 / 13))}


def test_pipeline_stages_are_compared_with_their_own_peers_only():
    # stage 1 computes twice stage 0 by design: no one lags; replica 1's stage 1 lags its peer
    second = {"key": 1, "compute": 0.020, "step": 0.023}
    rows = [row(key=0), row(**second), row(key=0), row(**second)]
    assert lagging(rows) == {}
    rows[3]["compute"] = 0.040
    assert list(lagging(rows)) == [3]
    assert lagging([row(key=0), row(key=1, compute=0.1)]) == {}  # no peers: nothing to compare


def test_a_rank_is_named_once_after_three_checks_in_a_row(capsys):
    health = Health(10, None, key=0, lockstep=True, speaks=True, last_step=100)
    slow = [row(), row(compute=0.030), row()]
    assert health.judge(10, slow) == [] and health.judge(20, [row()] * 3) == []  # a break resets
    named = [health.judge(step, slow) for step in (30, 40, 50, 60)]
    assert named[:CHECKS - 1] == [[]] * (CHECKS - 1) and named[CHECKS] == []
    lag = pytest.approx(1.538, abs=1e-3)
    assert named[CHECKS - 1] == [{"rank": 1, "term": "compute", "step": 50, "lag": lag}]
    assert "rank 1 is a straggler at step 50: its compute" in capsys.readouterr().err
    assert health.checks == 6


SETS = ["model.name=mlp", "model.hidden=256", "model.depth=3", "optim.epochs=3", "run.log_every=5",
        "run.health_every=5"]  # 69 steps


def _run(rank, world, run_dir, inject, extra=()):
    cfg = load_config(None, [*SETS, *extra, *([f"run.inject={inject}"] if inject else [])])
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


@pytest.mark.parametrize(("inject", "named"), [("slow:rank=1,factor=3", "compute"),
                                               ("slow_data:rank=1,factor=3", "input"), (None, None)])
def test_a_live_run_names_its_straggler_within_three_checks(tmp_path, inject, named):
    summary = run_workers(_run, 2, tmp_path, inject, timeout=180)[0]
    assert summary["health_checks"] == summary["steps"] // 5
    if named is None:
        assert summary["stragglers"] == []
        return
    first = summary["stragglers"][0]
    assert (first["rank"], first["term"]) == (1, named), summary["stragglers"]
    assert first["step"] <= 5 * (CHECKS + 1)  # three checks, and one more for the first steps' noise
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["stragglers"] for r in logged if "stragglers" in r][0][0] == first


def test_a_slow_last_stage_is_named_for_its_compute_not_its_peer_for_waiting(tmp_path):
    """dp2 x pp2: ranks 2 and 3 hold stage 1 (the last backward there waits for the data-parallel
    sync inside the stage's own time, which must not count as computing)."""
    pp = ["parallel.pp=2", "parallel.microbatches=2", "model.depth=4", "optim.epochs=2"]
    summary = run_workers(_run, 4, tmp_path, "slow:rank=3,factor=3", pp, timeout=240)[0]
    first = summary["stragglers"][0]
    assert (first["rank"], first["term"]) == (3, "compute"), summary["stragglers"]

"""Fault specs: parsed strictly, ranges checked, and the random straggler agreed on by every rank."""

import statistics

import pytest

from paraloom.config.errors import UserError
from paraloom.config.fault_specs import Fault, check_faults, parse_faults
from paraloom.train.faults import FaultInjector


def test_parse_every_kind():
    faults = parse_faults("kill:rank=1,step=30; hang:rank=2,step=10;nan:rank=0,step=5;"
                          "slow:rank=1,factor=2.0; slow:rank=random,factor=3")
    assert faults == [Fault("kill", 1, step=30), Fault("hang", 2, step=10), Fault("nan", 0, step=5),
                      Fault("slow", 1, factor=2.0), Fault("slow", None, factor=3.0)]
    assert faults[4].text() == "slow:rank=random,factor=3"


@pytest.mark.parametrize("text,message", [
    ("explode:rank=1,step=3", "unknown fault 'explode'"),
    ("kill:rank=1", "expected kill:rank=...,step=..."),
    ("kill:rank=1,step=3,step=4", "expected kill"),
    ("kill:rank=random,step=3", "rank must be a rank number"),
    ("kill:rank=-1,step=3", "rank must be a rank number"),
    ("nan:rank=0,step=0", "step must be a whole number >= 1"),
    ("slow:rank=1,factor=abc", "factor must be a number"),
    ("slow:rank=1,factor=0.5", "factor must lie in [1, 100]"),
    (" ; ", "run.inject is empty"),
])
def test_bad_specs_are_user_errors(text, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("...", r"\.\.\.")):
        parse_faults(text)


def test_ranks_and_steps_out_of_range():
    with pytest.raises(UserError, match="rank 4 is out of range; this run has ranks 0..3"):
        check_faults(parse_faults("kill:rank=4,step=1"), 4)
    with pytest.raises(UserError, match="step 99 is out of range; this run has steps 1..46"):
        check_faults(parse_faults("hang:rank=0,step=99"), 2, 46)
    check_faults(parse_faults("slow:rank=random,factor=2"), 2, 46)


def test_random_straggler_is_one_agreed_rank_per_step():
    faults = parse_faults("slow:rank=random,factor=2")
    injectors = [FaultInjector(faults, rank=r, world_size=4, seed=3, run_dir=None) for r in range(4)]
    chosen = []
    for step in range(1, 201):
        slow = [r for r, inj in enumerate(injectors) if inj.slow_factor(step) == 2.0]
        assert len(slow) == 1
        chosen.append(slow[0])
    assert set(chosen) == {0, 1, 2, 3}  # every rank gets its turn


def test_once_faults_fire_once_per_run_directory(tmp_path):
    faults = parse_faults("nan:rank=1,step=5")
    first = FaultInjector(faults, rank=1, world_size=2, seed=0, run_dir=tmp_path)
    assert not first.poison(4) and first.poison(5) and not first.poison(5)
    again = FaultInjector(faults, rank=1, world_size=2, seed=0, run_dir=tmp_path)  # after a restart
    assert not again.poison(5)
    other = FaultInjector(faults, rank=0, world_size=2, seed=0, run_dir=tmp_path)
    assert not other.poison(5)


def test_a_slow_step_sleeps_its_extra_computation_before_backward(monkeypatch):
    """`stretch` sleeps (factor - 1) x the last step's forward and backward (3x this forward on
    the first step), only on the slow rank."""
    slept = []
    monkeypatch.setattr("paraloom.train.faults.time.sleep", slept.append)
    faults = parse_faults("slow:rank=1,factor=2.5")
    slow = FaultInjector(faults, rank=1, world_size=2, seed=0, run_dir=None)
    fast = FaultInjector(faults, rank=0, world_size=2, seed=0, run_dir=None)
    assert slow.stretch(1, forward_seconds=0.01) == pytest.approx(0.045)  # 1.5 x 3 x 0.01
    slow.computed(0.04)
    assert slow.stretch(2, forward_seconds=0.01) == pytest.approx(0.06)  # 1.5 x 0.04
    assert fast.stretch(1, forward_seconds=0.01) == 0.0
    assert slept == pytest.approx([0.045, 0.06])


def _computed_per_step(rank, world, cfg):
    """Each step's computation as the fault injector was told it (what a slow step's sleep multiplies)."""
    import torch

    from paraloom.train import train

    seen = []
    original = FaultInjector.computed

    def record(self, seconds):
        seen.append(seconds)
        original(self, seconds)

    FaultInjector.computed = record
    train(cfg, None, device=torch.device("cpu"))
    return seen


def test_a_transient_stragglers_sleep_does_not_grow_with_its_peers_waits():
    """Data parallelism: backward returns once the gradients are averaged, so it holds the wait for a
    slow peer. Counted as computation, a rank that had waited slept that wait again when its turn came,
    and the steps grew one after another."""
    from distributed import run_workers

    from paraloom.config import load_config

    cfg = load_config(None, ["model.name=mlp", "model.hidden=1024", "data.batch_size=256",
                             "run.checkpoint_every=0", "optim.max_steps=30",
                             "run.inject=slow:rank=random,factor=2"])
    for seen in run_workers(_computed_per_step, 2, cfg, timeout=120):
        steady = seen[5:]  # counted with the waits: max 4.9-6.1x the median; without: 1.5-1.8x
        assert max(steady) < 3 * statistics.median(steady), seen

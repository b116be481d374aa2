"""Learning-rate factors at the steps that define each schedule, through LambdaLR, and refusals."""

import math

import pytest
import torch

from paraloom.config import choices
from paraloom.config.errors import UserError
from paraloom.optim import SCHEDULES, lr_factor, make_schedule


def _factors(n, **settings):
    return [lr_factor(s, **settings) for s in range(n)]


def test_the_names_are_the_config_choices():
    assert SCHEDULES == choices.LR_SCHEDULES


@pytest.mark.parametrize("kind", SCHEDULES)
def test_warm_up_ramps_linearly_from_the_first_step(kind):
    factors = _factors(4, kind=kind, warmup_steps=4, total_steps=10, step_every=2)
    assert factors == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, kind=kind, warmup_steps=4, total_steps=10, step_every=2) == 1.0
    assert lr_factor(0, kind=kind, warmup_steps=0, total_steps=10, step_every=2) == 1.0  # no warm-up


def test_constant_stays_at_one():
    assert _factors(12, kind="constant", warmup_steps=2, total_steps=10, min_lr_ratio=0.5)[2:] == [1.0] * 10


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_cosine_halves_at_the_midpoint_and_ends_at_the_minimum(min_lr_ratio):
    settings = dict(kind="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=min_lr_ratio)
    assert lr_factor(2, **settings) == 1.0
    assert lr_factor(7, **settings) == pytest.approx((1 + min_lr_ratio) / 2)
    assert lr_factor(4, **settings) == pytest.approx(min_lr_ratio + (1 - min_lr_ratio)
                                                     * (1 + math.cos(math.pi / 5)) / 2)
    assert lr_factor(12, **settings) == pytest.approx(min_lr_ratio)
    assert lr_factor(50, **settings) == pytest.approx(min_lr_ratio)
    factors = _factors(13, **settings)[2:]
    assert all(a > b for a, b in zip(factors, factors[1:], strict=False))


def test_linear_falls_evenly_to_the_minimum_and_decay_steps_can_end_it_early():
    settings = dict(kind="linear", warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    assert _factors(11, **settings)[2:] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    early = dict(settings, decay_steps=4)
    assert _factors(11, **early)[2:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2, 0.2, 0.2])


def test_step_drops_by_gamma_and_not_below_the_minimum():
    settings = dict(kind="step", warmup_steps=0, total_steps=9, step_gamma=0.5, step_every=3)
    assert _factors(10, **settings) == pytest.approx([1, 1, 1, .5, .5, .5, .25, .25, .25, .125])
    assert _factors(10, **dict(settings, step_every=None)) == _factors(10, **settings)  # a third of the run
    assert lr_factor(9, **dict(settings, min_lr_ratio=0.3)) == 0.3
    assert lr_factor(20, **settings) == 0.125  # held after the run's end


def test_lambda_lr_applies_the_factor_to_every_group():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}], lr=0.4)
    settings = dict(kind="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.25)
    schedule = make_schedule(opt, **settings)
    seen = []
    for _ in range(8):
        seen.extend(g["lr"] for g in opt.param_groups)
        opt.step()
        schedule.step()
    expected = [base * lr_factor(s, **settings) for s in range(8) for base in (0.4, 0.1)]
    assert seen == pytest.approx(expected)
    assert seen[:2] == pytest.approx([0.2, 0.05]) and seen[12:14] == pytest.approx([0.1, 0.025])


@pytest.mark.parametrize("settings, words", [
    (dict(warmup_steps=10, total_steps=10), "optim.warmup_steps=10 must lie in [0, 10)"),
    (dict(warmup_steps=-1, total_steps=10), "optim.warmup_steps=-1"),
    (dict(total_steps=0), "at least one"),
    (dict(kind="exp", total_steps=10), "optim.schedule='exp' is not a schedule; choose one of: constant,"),
    (dict(kind="step", total_steps=10, step_every=0), "optim.step_every=0 must be a positive"),
    (dict(total_steps=10, min_lr_ratio=1.5), "optim.min_lr_ratio=1.5"),
    (dict(total_steps=10, step_gamma=0.0), "optim.step_gamma=0.0"),
    (dict(total_steps=10, decay_steps=0), "decay_steps=0"),
])
def test_settings_it_cannot_honour_are_refused(settings, words):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for call in (lambda: make_schedule(opt, **settings), lambda: lr_factor(0, **settings)):
        with pytest.raises(UserError) as excinfo:
            call()
        assert words in str(excinfo.value) and "\n" not in str(excinfo.value)

"""Optimizers by name: spellings, shorthand against options, fused kernels, one-line refusals."""

import pytest
import torch

from paraloom.config import choices
from paraloom.config.errors import UserError
from paraloom.optim import LAMB, LARS, check_optimizer, make_optimizer, optimizer_names


def _params():
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("adamw", torch.optim.AdamW),
                                       ("ADAMW", torch.optim.AdamW), ("sgd", torch.optim.SGD),
                                       ("RMSprop", torch.optim.RMSprop), ("rmsprop", torch.optim.RMSprop),
                                       ("Adagrad", torch.optim.Adagrad), ("lars", LARS), ("LAMB", LAMB)])
def test_any_spelling_builds_the_class(name, cls):
    assert type(make_optimizer(name, _params(), lr=0.1)) is cls


def test_names_are_the_optimizer_classes_and_cover_the_usual_ones():
    names = optimizer_names()
    assert names == sorted(names, key=str.lower)
    assert {"Adam", "AdamW", "SGD", "RMSprop", "LARS", "LAMB"} <= set(names)
    assert "Optimizer" not in names and "LambdaLR" not in names
    assert set(choices.OPTIMIZERS) <= {n.lower() for n in names}


def test_shorthand_goes_only_where_taken_and_options_win():
    sgd = make_optimizer("sgd", _params(), lr=0.1, momentum=0.9, weight_decay=0.01,
                         options={"lr": 0.5, "nesterov": True})
    group = sgd.param_groups[0]
    assert [group[k] for k in ("lr", "momentum", "weight_decay", "nesterov")] == [0.5, 0.9, 0.01, True]
    adam = make_optimizer("adam", _params(), lr=0.1, momentum=0.9)  # Adam takes no momentum
    assert adam.param_groups[0]["lr"] == 0.1 and "momentum" not in adam.param_groups[0]
    lars = make_optimizer("lars", _params(), lr=0.1, momentum=0.8, options={"eta": 0.01})
    assert (lars.param_groups[0]["momentum"], lars.param_groups[0]["eta"]) == (0.8, 0.01)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "adagrad"])
def test_fused_kernels_are_chosen_for_cpu_float_params(name):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).double())
    opt = make_optimizer(name, model.parameters(), lr=0.1)  # a generator, read once
    assert opt.defaults["fused"] is True and len(opt.param_groups[0]["params"]) == 4
    unfused = make_optimizer(name, _params(), lr=0.1, options={"fused": False})
    assert not unfused.defaults["fused"]


def test_no_fused_kernel_where_the_params_or_options_rule_it_out():
    meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    assert not make_optimizer("adam", meta, lr=0.1).defaults["fused"]
    foreach = make_optimizer("adam", _params(), lr=0.1, options={"foreach": True})
    assert foreach.defaults["foreach"] and not foreach.defaults["fused"]
    groups = [{"params": iter(_params()), "lr": 0.2}]
    assert make_optimizer("sgd", groups, lr=0.1).defaults["fused"] is True
    assert "fused" not in make_optimizer("rmsprop", _params(), lr=0.1).defaults


def test_a_fused_step_matches_the_plain_one():
    a = _params()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused = make_optimizer("adamw", a, lr=0.1, weight_decay=0.01)
    plain = make_optimizer("adamw", b, lr=0.1, weight_decay=0.01, options={"fused": False})
    for opt, params in ((fused, a), (plain, b)):
        for _ in range(3):
            for p in params:
                p.grad = p.detach() ** 2
            opt.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_unknown_names_are_refused_with_the_choices():
    for name in ("adamx", "Optimizer", "LambdaLR"):
        with pytest.raises(UserError) as excinfo:
            make_optimizer(name, _params(), lr=0.1)
        assert _one_line(excinfo) == (f"optim.name={name!r} is not a torch.optim optimizer; choose one of: "
                                      + ", ".join(optimizer_names()))


def test_options_the_constructor_does_not_take_are_named():
    with pytest.raises(UserError) as excinfo:
        make_optimizer("sgd", _params(), lr=0.1, options={"betas": (0.9, 0.99), "nesterov": True})
    message = _one_line(excinfo)
    assert message.startswith("optim.options betas: SGD does not take it; it takes: ")
    assert "nesterov" in message and "momentum" in message


@pytest.mark.parametrize("name, options, words", [
    ("sgd", {"lr": -1.0}, ["SGD", "Invalid learning rate: -1.0"]),
    ("adam", {"betas": (1.5, 0.9)}, ["Adam", "beta"]),
    ("lamb", {"betas": (0.9, 1.0)}, ["LAMB", "betas"]),
    ("lars", {"eta": -1.0}, ["LARS", "eta"]),
    ("adamw", {"betas": 0.9}, ["AdamW"]),  # a TypeError inside the constructor
])
def test_bad_values_become_one_line_user_errors(name, options, words):
    with pytest.raises(UserError) as excinfo:
        make_optimizer(name, _params(), lr=0.1, options=options)
    message = _one_line(excinfo)
    assert all(word in message for word in words), message


def test_check_optimizer_needs_no_params():
    assert check_optimizer("AdamW", {"betas": (0.9, 0.95)}) is torch.optim.AdamW
    assert check_optimizer("lamb") is LAMB
    with pytest.raises(UserError, match="momentum: AdamW does not take it"):
        check_optimizer("adamw", {"momentum": 0.9})
    with pytest.raises(UserError, match="must be a mapping"):
        check_optimizer("sgd", ["lr"])
    with pytest.raises(UserError, match="choose one of"):
        check_optimizer("nope")

"""optim.no_decay: which parameters it marks, the groups the optimizer gets, and what it refuses."""

import pytest
import torch
from torch import nn

from paraloom.config.errors import UserError
from paraloom.optim.groups import decay_groups, mark_no_decay, no_decay_patterns


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 2, bias=False))


def _exempt(model):
    groups = decay_groups(model.parameters())
    if all(torch.is_tensor(g) for g in groups):  # nothing exempt: the parameters as they came
        groups = [{"params": groups}]
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in groups], [g.get("weight_decay") for g in groups]


def test_patterns_are_comma_separated_and_trimmed():
    assert no_decay_patterns(" 1d, *.bias ,") == ["1d", "*.bias"]
    assert no_decay_patterns(None) == []


@pytest.mark.parametrize(("text", "exempt"), [
    ("1d", ["1.weight", "1.bias", "2.bias"]),  # biases and the norm's scale: fewer than two dims
    ("*.bias", ["1.bias", "2.bias"]),
    ("1.*,0.weight", ["0.weight", "1.weight", "1.bias"]),  # a 2-D embedding, by its name
])
def test_the_marked_parameters_form_a_group_without_weight_decay(text, exempt):
    model = _net()
    assert mark_no_decay(model, text) == len(exempt)
    names, decays = _exempt(model)
    assert names[-1] == exempt and decays == [None, 0.0]  # the decayed group keeps the optimizer's rate
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in model.named_parameters())


def test_nothing_marked_leaves_one_plain_list():
    model = _net()
    assert mark_no_decay(model, None) == 0
    assert decay_groups(model.parameters()) == list(model.parameters())


def test_a_pattern_that_matches_nothing_names_itself_and_the_models_names():
    message = (r"optim.no_decay '\*.bais' matches no parameter of the model "
               r"\(its parameters are named like 0.weight, 1.weight, 1.bias, 2.weight\)")
    with pytest.raises(UserError, match=message):
        mark_no_decay(_net(), "*.bias,*.bais")


def test_marks_are_redone_after_surgery_and_follow_the_parameter():
    model = _net()
    mark_no_decay(model, "2.*")
    model[2] = nn.Linear(4, 4)  # a replaced layer (as tensor parallelism replaces them) is unmarked...
    assert _exempt(model)[0] == [[n for n, _ in model.named_parameters()]]
    mark_no_decay(model, "2.*")  # ...until marked again
    stage = nn.Sequential(model[2], model[3])  # a pipeline stage: names change, marks stay
    assert [len(g["params"]) for g in decay_groups(stage.parameters())] == [1, 2]


def test_an_optimizer_steps_the_exempt_group_without_decay():
    model = _net()
    mark_no_decay(model, "1d")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: AdamW's step is its decay alone
    torch.optim.AdamW(decay_groups(model.parameters()), lr=0.1, weight_decay=0.5).step()
    for name, p in model.named_parameters():
        factor = 1.0 if name in ("1.weight", "1.bias", "2.bias") else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=name)

"""LARS and LAMB step for step like their textbook formulas, resume from a state_dict, reduce to SGD/AdamW."""

import io

import optim_reference as ref
import pytest
import torch

from paraloom.optim import LAMB, LARS

STEPS = 5
LARS_SETTINGS = dict(lr=2.0, momentum=0.9, eta=0.02)


def _run(opt, params, noises):
    """Step `opt` once per entry of `noises`, each gradient computed from the current parameters."""
    for step_noise in noises:
        for p, n in zip(params, step_noise, strict=True):
            p.grad = ref.grad(p.detach(), n)
        opt.step()
    return opt


def _params(dtype=torch.float64):
    return [torch.nn.Parameter(t) for t in ref.make_tensors(dtype)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lars_matches_the_textbook(weight_decay, dtype):
    params, noises = _params(dtype), ref.noise(STEPS, dtype)
    _run(LARS(params, weight_decay=weight_decay, **LARS_SETTINGS), params, noises)
    expected = ref.lars(ref.make_tensors(dtype), noises, weight_decay=weight_decay, **LARS_SETTINGS)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e)
    sgd = _params(dtype)
    _run(torch.optim.SGD(sgd, lr=2.0, momentum=0.9, weight_decay=weight_decay), sgd, noises)
    assert not torch.allclose(params[0], sgd[0])  # the trust ratio is no no-op in these numbers


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lamb_matches_the_textbook(weight_decay, dtype):
    params, noises = _params(dtype), ref.noise(STEPS, dtype)
    _run(LAMB(params, lr=0.05, weight_decay=weight_decay), params, noises)
    expected = ref.lamb(ref.make_tensors(dtype), noises, lr=0.05, weight_decay=weight_decay)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e)


def test_without_trust_lars_is_sgd_and_lamb_is_adamw():
    noises = ref.noise(STEPS)
    pairs = [(LARS, dict(lr=0.1, momentum=0.9, weight_decay=0.01), torch.optim.SGD),
             (LAMB, dict(lr=0.05, eps=1e-6, weight_decay=0.01), torch.optim.AdamW)]
    for ours, settings, theirs in pairs:
        a, b = _params(), _params()
        _run(ours([{"params": a, "trust": False}], **settings), a, noises)
        _run(theirs(b, **settings), b, noises)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)


def test_a_group_without_trust_leaves_biases_unadapted():
    noises = ref.noise(STEPS)
    params = _params()
    weights, biases = [params[0], params[2]], [params[1], params[3], params[4]]
    opt = LAMB([{"params": weights}, {"params": biases, "trust": False, "weight_decay": 0.0}],
               lr=0.05, weight_decay=0.01)
    _run(opt, params, noises)
    adapted = ref.lamb(ref.make_tensors(), noises, lr=0.05, weight_decay=0.01)
    for i in (0, 2):
        torch.testing.assert_close(params[i].detach(), adapted[i])
    plain = _params()
    adamw = torch.optim.AdamW(plain, lr=0.05, eps=1e-6, weight_decay=0.0)
    _run(adamw, plain, noises)
    for i in (1, 3, 4):
        torch.testing.assert_close(params[i], plain[i])


@pytest.mark.parametrize("opt_cls, settings", [(LARS, dict(weight_decay=0.01, **LARS_SETTINGS)),
                                               (LAMB, dict(lr=0.05, weight_decay=0.01))])
def test_state_dict_round_trip_continues_identically(opt_cls, settings):
    noises = ref.noise(2 * STEPS)
    first = _params()
    opt = _run(opt_cls(first, **settings), first, noises[:STEPS])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = opt_cls(second, **settings)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for this, params in ((opt, first), (resumed, second)):
        _run(this, params, noises[STEPS:])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    fresh = _params()
    _run(opt_cls(fresh, **settings), fresh, noises[STEPS:])  # without the state the run differs
    assert not torch.equal(fresh[0], first[0])


def test_bad_values_are_refused():
    params = _params()
    with pytest.raises(ValueError, match="learning rate"):
        LARS(params, lr=-1.0)
    with pytest.raises(ValueError, match="eta"):
        LARS(params, eta=0.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(params, betas=(1.0, 0.999))

"""trace_modules: one forward and one backward span per parameter-owning module, in the right order."""

import pytest
import torch
from torch import nn

from paraloom.models import CNN, MLP
from paraloom.trace import Timeline, trace_modules


def _compute_spans(tl):
    return [e for e in tl.to_chrome()["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]


def _step(model, x):
    model(x).sum().backward()


@pytest.mark.parametrize(("model", "x", "owners"), [
    (MLP((8,), 3, hidden=16, depth=2), torch.randn(4, 8), ["1", "3", "5"]),
    (CNN((1, 8, 8), 3, channels=4, hidden=8), torch.randn(2, 1, 8, 8), ["0", "2", "6", "8"]),
])
def test_forward_then_backward_in_reverse_per_step(model, x, owners):
    tl = Timeline(0)
    trace_modules(model, tl)
    _step(model, x)  # inactive: nothing
    tl.active = True
    steps = 2
    for _ in range(steps):
        _step(model, x)
    spans = _compute_spans(tl)
    one_step = [f"forward {n}" for n in owners] + [f"backward {n}" for n in reversed(owners)]
    assert [e["name"] for e in spans] == one_step * steps
    for k in range(steps):
        mine = spans[k * len(one_step):(k + 1) * len(one_step)]
        forward, backward = mine[:len(owners)], mine[len(owners):]
        starts = [e["ts"] for e in forward]
        assert starts == sorted(starts)
        assert [e["ts"] for e in backward] == sorted(e["ts"] for e in backward)  # last layer first
        assert min(e["ts"] for e in backward) >= max(e["ts"] + e["dur"] for e in forward)
        assert all(e["dur"] > 0 for e in mine)


def test_first_layer_backward_ends_after_its_gradients():
    """The first layer's input needs no gradient: its span must still cover its weight gradient."""
    model = MLP((8,), 3, hidden=16, depth=1)
    tl = Timeline(0)
    tl.active = True
    done = []
    for param in model[1].parameters():  # registered first, so these run before trace_modules' hooks
        param.register_post_accumulate_grad_hook(lambda p: done.append(tl.now()))
    trace_modules(model, tl)
    _step(model, torch.randn(4, 8))
    [first] = [e for e in _compute_spans(tl) if e["name"] == "backward 1"]
    assert len(done) == 2
    assert (first["ts"] + first["dur"]) / 1e6 + tl.origin >= max(done) - 1e-6


def test_no_grad_forward_records_forward_only_and_removed_hooks_record_nothing():
    model = MLP((8,), 3, hidden=16, depth=2)
    tl = Timeline(0)
    tl.active = True
    handles = trace_modules(model, tl)
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert [e["name"] for e in _compute_spans(tl)] == ["forward 1", "forward 3", "forward 5"]
    for handle in handles:
        handle.remove()
    _step(model, torch.randn(2, 8))
    assert len(_compute_spans(tl)) == 3


def test_in_place_ops_on_a_traced_output_and_accumulated_micro_batches():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    tl = Timeline(0)
    tl.active = True
    trace_modules(model, tl)
    for _ in range(2):  # two micro-batches, one backward each, into the same .grad
        _step(model, torch.randn(3, 4))
    names = [e["name"] for e in _compute_spans(tl)]
    assert names == ["forward 0", "forward 2", "backward 2", "backward 0"] * 2


def test_root_module_with_own_parameters_is_named_by_class():
    tl = Timeline(0)
    tl.active = True
    model = nn.Linear(3, 2)
    trace_modules(model, tl)
    _step(model, torch.randn(2, 3))
    assert [e["name"] for e in _compute_spans(tl)] == ["forward Linear", "backward Linear"]

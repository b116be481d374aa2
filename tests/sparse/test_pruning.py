"""Sparsity schedules (pure) and magnitude pruning: exact counts, shrinking masks, rank agreement, Adam."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from torch import nn

from paraloom.config.errors import UserError
from paraloom.models.gpt import GPT
from paraloom.models.mlp import MLP
from paraloom.sparse import MagnitudePruner, SparsitySchedule, cubic_sparsity, is_prune_step

torch.set_num_threads(1)

MODES = {"layer": {"scope": "layer"}, "global": {"scope": "global"},
         "structured": {"scope": "layer", "structured": True}}


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP((12,), 4, hidden=16, depth=2)


def oneshot(final: float) -> SparsitySchedule:
    return SparsitySchedule("oneshot", final=final)


# -- schedules (pure) -----------------------------------------------------------------------------
def test_cubic_sparsity_literal_values():
    kw = {"initial": 0.0, "final": 0.8, "start": 10, "end": 110}
    assert cubic_sparsity(0, **kw) == 0.0
    assert cubic_sparsity(10, **kw) == 0.0
    assert cubic_sparsity(60, **kw) == pytest.approx(0.8 - 0.8 * 0.5 ** 3)  # 0.7
    assert cubic_sparsity(110, **kw) == pytest.approx(0.8)
    assert cubic_sparsity(500, **kw) == 0.8
    kw = {"initial": 0.2, "final": 0.8, "start": 0, "end": 100}
    assert cubic_sparsity(0, **kw) == pytest.approx(0.2)
    assert cubic_sparsity(50, **kw) == pytest.approx(0.725)
    assert cubic_sparsity(75, **kw) == pytest.approx(0.8 - 0.6 / 64)
    assert cubic_sparsity(5, initial=0.1, final=0.5, start=5, end=5) == 0.5  # no ramp: a step


def test_is_prune_step():
    assert [s for s in range(30) if is_prune_step(s, 4, 20, 8)] == [4, 12, 20]
    assert [s for s in range(30) if is_prune_step(s, 3, 3, 1)] == [3]


def test_oneshot_due_exactly_once():
    sched = SparsitySchedule("oneshot", final=0.5, start=7)
    assert [s for s in range(100) if sched.due(s)] == [7]
    assert sched.target(6) == 0.0 and sched.target(7) == 0.5 and sched.target(99) == 0.5


def test_gradual_due_every_and_cubic_target():
    sched = SparsitySchedule("gradual", final=0.9, initial=0.1, start=10, end=90, every=20)
    assert [s for s in range(200) if sched.due(s)] == [10, 30, 50, 70, 90]
    assert sched.target(10) == pytest.approx(0.1) and sched.target(90) == pytest.approx(0.9)
    assert sched.target(50) == pytest.approx(0.9 - 0.8 / 8)
    targets = [sched.target(s) for s in range(0, 120)]
    assert targets == sorted(targets)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"kind": "cubic", "final": 0.5}, "gradual, oneshot"),
    ({"kind": "oneshot", "final": 1.0}, "final < 1"),
    ({"kind": "oneshot", "final": -0.1}, "0 <= initial"),
    ({"kind": "gradual", "final": 0.5, "initial": 0.6, "end": 10}, "initial <= final"),
    ({"kind": "gradual", "final": 0.5, "start": 10, "end": 5}, "start <= end"),
    ({"kind": "gradual", "final": 0.5, "end": 10, "every": 0}, "every=0"),
    ({"kind": "gradual", "final": 0.5}, "needs end="),
    ({"kind": "gradual", "final": 0.5, "end": 10, "every": 3}, "use end=9 or end=12"),
])
def test_schedule_validation(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        SparsitySchedule(**kwargs)


# -- pruning ----------------------------------------------------------------------------------------
def test_default_targets_are_linear_and_conv_weights_only():
    torch.manual_seed(0)
    gpt = GPT((8,), 32, n_layers=1, d_model=16, n_heads=2)
    names = list(MagnitudePruner(gpt, oneshot(0.5)).masks)
    assert names == ["1.attn.qkv.weight", "1.attn.proj.weight", "1.mlp.fc.weight", "1.mlp.proj.weight",
                     "2.out.weight"]
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    assert list(MagnitudePruner(conv, oneshot(0.5)).masks) == ["0.weight", "3.weight"]


def test_per_layer_hits_target_per_tensor():
    model = mlp()
    pruner = MagnitudePruner(model, oneshot(0.7))
    assert pruner.density() == 1.0 and all(m.all() for m in pruner.masks.values())
    weights = {n: p.detach().clone() for n, p in pruner.targets.items()}
    assert pruner.update(0) is True
    for name, p in pruner.targets.items():
        mask = pruner.masks[name]
        assert mask.dtype == torch.bool and mask.shape == p.shape
        assert int((~mask).sum()) == round(0.7 * p.numel())
        assert weights[name][~mask].abs().max() <= weights[name][mask].abs().min()
        assert (p[~mask] == 0).all() and torch.equal(p[mask], weights[name][mask])
        assert pruner.layer_sparsity()[name] == pytest.approx(0.7, abs=1 / p.numel())
    assert isinstance(model[1].weight, nn.Parameter) and model[1].bias.ne(0).all()  # biases untouched


def test_global_hits_target_overall_with_uneven_layers():
    model = mlp()
    with torch.no_grad():
        model[1].weight.mul_(10)  # a layer of large weights keeps more of them under one threshold
    pruner = MagnitudePruner(model, oneshot(0.6), scope="global")
    weights = torch.cat([p.detach().reshape(-1).abs() for p in pruner.targets.values()])
    pruner.update(0)
    masks = torch.cat([m.reshape(-1) for m in pruner.masks.values()])
    assert int((~masks).sum()) == round(0.6 * masks.numel())
    assert pruner.sparsity() == pytest.approx(0.6, abs=1 / masks.numel())
    assert weights[~masks].max() <= weights[masks].min()
    per_layer = pruner.layer_sparsity()
    assert per_layer["1.weight"] < 0.2 and per_layer["3.weight"] > 0.7


def test_structured_prunes_whole_rows_and_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 10, 3), nn.Flatten(), nn.Linear(40, 8))
    pruner = MagnitudePruner(model, oneshot(0.5), structured=True)
    norms = {n: p.detach().reshape(p.shape[0], -1).norm(dim=1) for n, p in pruner.targets.items()}
    pruner.update(0)
    for name, p in pruner.targets.items():
        rows = pruner.masks[name].reshape(p.shape[0], -1)
        kept = rows.all(dim=1)
        assert torch.equal(rows.any(dim=1), kept)  # each row all kept or all pruned
        assert int((~kept).sum()) == p.shape[0] // 2
        assert norms[name][~kept].max() <= norms[name][kept].min()
        assert (p.reshape(p.shape[0], -1)[~kept] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_masks_only_shrink(mode):
    model = mlp()
    sched = SparsitySchedule("gradual", final=0.8, start=0, end=40, every=10)
    pruner = MagnitudePruner(model, sched, **MODES[mode])
    previous, sparsities = pruner.masks, []
    for step in range(41):
        if pruner.update(step):
            for name, mask in pruner.masks.items():
                assert not (mask & ~previous[name]).any(), f"{name} revived a pruned weight"
            previous = pruner.masks
            sparsities.append(pruner.sparsity())
        with torch.no_grad():  # revive pruned weights as huge values: they must stay pruned
            for name, p in pruner.targets.items():
                p.masked_fill_(~pruner.masks[name], 100.0)
    assert sparsities == sorted(sparsities)
    # step 0 prunes 0 %: no change; structured rounds rows, so 78.75 % and 80 % both prune 13 of 16
    assert len(sparsities) == (3 if mode == "structured" else 4)
    assert pruner.sparsity() == pytest.approx(0.8, abs=0.05)
    assert pruner.last_step == 40 and pruner.target_sparsity == pytest.approx(0.8)


@pytest.mark.parametrize("mode", MODES)
def test_ties_are_deterministic(mode):
    def masks():
        layer = nn.Linear(5, 6)
        with torch.no_grad():
            layer.weight.fill_(0.5)
        pruner = MagnitudePruner(layer, oneshot(0.5), targets=[("w", layer.weight)], **MODES[mode])
        pruner.update(0)
        return pruner.masks["w"]

    first = masks()
    assert torch.equal(first, masks())
    if mode == "structured":
        assert first.all(dim=1).tolist() == [False] * 3 + [True] * 3  # lowest row indices go first
    else:
        assert first.reshape(-1).tolist() == [False] * 15 + [True] * 15


def test_user_errors():
    with pytest.raises(UserError, match="layer, global"):
        MagnitudePruner(mlp(), oneshot(0.5), scope="tensor")
    with pytest.raises(UserError, match="scope='layer'"):
        MagnitudePruner(mlp(), oneshot(0.5), scope="global", structured=True)
    with pytest.raises(UserError, match="targets="):
        MagnitudePruner(nn.Sequential(nn.LayerNorm(4)), oneshot(0.5))
    model = mlp()
    with pytest.raises(UserError, match="twice"):
        MagnitudePruner(model, oneshot(0.5), targets=[("a", model[1].weight), ("a", model[3].weight)])
    state = MagnitudePruner(model, oneshot(0.5)).state_dict()
    with pytest.raises(UserError, match="missing"):
        MagnitudePruner(model, oneshot(0.5), targets=[("a", model[1].weight)]).load_state_dict(state)


def _train_adam(model: nn.Module, pruner: MagnitudePruner, steps: int, seed: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pruner.mask_gradients()
        for name, p in pruner.targets.items():
            assert (p.grad[~pruner.masks[name]] == 0).all()
        opt.step()
        pruner.apply()
        for name, p in pruner.targets.items():
            assert (p[~pruner.masks[name]] == 0).all()


def test_pruned_weights_stay_zero_through_adam_and_state_round_trips(tmp_path):
    model = mlp()
    pruner = MagnitudePruner(model, oneshot(0.75))
    pruner.mask_gradients()  # no gradients yet: nothing to do
    pruner.update(0)
    with torch.no_grad():  # give Adam momentum that would revive pruned weights without apply()
        for p in pruner.targets.values():
            p.add_(0.01)
    pruner.apply()
    _train_adam(model, pruner, 20, seed=1)
    assert pruner.sparsity() == pytest.approx(0.75, abs=0.01)

    torch.save({"model": model.state_dict(), "pruner": pruner.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = mlp(seed=5)
    fresh.load_state_dict(ckpt["model"])
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # pruned entries now nonzero: load_state_dict must zero them again
    restored = MagnitudePruner(fresh, oneshot(0.75))
    restored.load_state_dict(ckpt["pruner"])
    assert restored.masks.keys() == pruner.masks.keys()
    for name, mask in pruner.masks.items():
        assert restored.masks[name].dtype == torch.bool and torch.equal(restored.masks[name], mask)
        assert (restored.targets[name][~mask] == 0).all()
    assert restored.last_step == 0 and restored.target_sparsity == pytest.approx(0.75)
    assert restored.update(0) is False  # idempotent at the same step


# -- many ranks -------------------------------------------------------------------------------------
def _prune_on_rank(rank: int, world_size: int, mode: str):
    model = mlp()
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():  # replicas that disagree: each rank alone would pick different masks
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    pruner = MagnitudePruner(model, oneshot(0.6), **MODES[mode])
    weights = {n: p.detach().clone() for n, p in pruner.targets.items()}
    changed = pruner.update(0)
    zeros = all(bool((p[~pruner.masks[n]] == 0).all()) for n, p in pruner.targets.items())
    return pruner.masks, weights, changed, zeros


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_masks_identical_on_every_rank(world_size, mode):
    results = run_workers(_prune_on_rank, world_size, mode)
    rank0 = results[0][0]
    local = []
    for masks, weights, changed, zeros in results:
        assert changed and zeros
        assert masks.keys() == rank0.keys()
        assert all(torch.equal(masks[n], rank0[n]) for n in rank0)
        alone = MagnitudePruner(nn.Module(), oneshot(0.6), targets=list(weights.items()), **MODES[mode])
        alone.update(0)  # no process group here: the masks this rank would pick by itself
        local.append(alone.masks)
    assert all(torch.equal(local[0][n], rank0[n]) for n in rank0)
    assert any(not torch.equal(loc[n], rank0[n]) for loc in local[1:] for n in rank0)
    assert math.isclose(sum(int(m.sum()) for m in rank0.values()),
                        sum(int(m.sum()) for m in local[1].values()), rel_tol=0.05)

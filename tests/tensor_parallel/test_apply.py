"""A tensor-parallel GPT trains exactly like one unsplit process: TP 2 and 4, SGD and Adam, and DP2 x TP2."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config.errors import UserError
from paraloom.data_parallel import DataParallel
from paraloom.models.gpt import GPT
from paraloom.tensor_parallel import (
    ColumnParallelLinear,
    apply_tensor_parallel,
    full_state_dict,
    load_full_state_dict,
    param_bytes,
    tp_loss,
)
from paraloom.topology import Topology

SEQ, VOCAB, BATCH, STEPS = 16, 256, 4, 5


def make_gpt(seed=0, **kwargs):
    torch.manual_seed(seed)
    return GPT((SEQ,), VOCAB, n_layers=2, d_model=32, n_heads=4, **kwargs)


def make_batches(n=STEPS, batch=BATCH):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, batch, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def make_optimizer(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def assert_same_parameters(state, ref_state, name=""):
    """Every parameter equal at fp32 default tolerances, but for the attention's key bias under Adam.

    The key bias has an exactly zero true gradient (adding one vector to every key shifts each
    query's scores by a constant, which softmax ignores), so its computed gradient is rounding
    noise (~1e-10) that Adam, being scale-free, turns into steps of size lr in either direction.
    Its value changes nothing the model computes; its query and value neighbours are compared.
    """
    assert state.keys() == ref_state.keys()
    d_model = 32
    for key, value in ref_state.items():
        mine = state[key]
        if name == "adam" and key.endswith("attn.qkv.bias"):
            keep = torch.cat([torch.arange(d_model), torch.arange(2 * d_model, 3 * d_model)])
            mine, value = mine[keep], value[keep]
        assert_close(mine, value, msg=lambda m, key=key: f"{name} {key}: {m}")


def full_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(model, optimizer_name, loss_fn, batches):
    optimizer = make_optimizer(optimizer_name, model)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def reference(optimizer_name, batches):
    """One unsplit process, on one thread as the workers are: with more, a matmul may sum in another
    order, and Adam's scale-free steps carry that last bit past fp32 tolerances."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_gpt()
        losses = train(model, optimizer_name, full_loss, batches)
    finally:
        torch.set_num_threads(threads)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_tp(rank, world):
    out = {}
    for name in ("sgd", "adam"):
        model = apply_tensor_parallel(make_gpt(), None)
        assert isinstance(model[1].attn.qkv, ColumnParallelLinear) and model[1].attn.n_heads == 4 // world
        losses = train(model, name, lambda logits, y: tp_loss(logits, y, None), make_batches())
        out[name] = (losses, full_state_dict(model, None))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_training_equals_single_process(tp):
    results = run_workers(_train_tp, tp)
    for name in ("sgd", "adam"):
        ref_losses, ref_state = reference(name, make_batches())
        for rank_result in results:
            losses, state = rank_result[name]
            assert_close(torch.tensor(losses), torch.tensor(ref_losses))
            assert_same_parameters(state, ref_state, name)


def _train_llama_tp(rank, world):
    model = apply_tensor_parallel(make_gpt(style="llama", ffn=48), None)
    assert model[1].mlp.fc.weight.shape[0] == 2 * 48 // world and model[1].attn.qkv.bias is None
    losses = train(model, "sgd", lambda logits, y: tp_loss(logits, y, None), make_batches())
    return losses, full_state_dict(model, None)


def test_llama_style_training_equals_single_process():
    """Rotary positions, RMS norms and a SwiGLU MLP whose gate and up rows each rank keeps in pairs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_gpt(style="llama", ffn=48)
        ref_losses = train(model, "sgd", full_loss, make_batches())
    finally:
        torch.set_num_threads(threads)
    for losses, state in run_workers(_train_llama_tp, 2):
        assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert_same_parameters(state, model.state_dict(), "sgd")


def _state_and_memory(rank, world):
    full = make_gpt()
    model = apply_tensor_parallel(make_gpt(), dist.group.WORLD)
    rebuilt = full_state_dict(model, dist.group.WORLD)
    for key, value in full.state_dict().items():
        assert torch.equal(rebuilt[key], value), key
    other = make_gpt(seed=7).state_dict()
    load_full_state_dict(model, other)
    for key, value in full_state_dict(model, dist.group.WORLD).items():
        assert torch.equal(value, other[key]), key
    return param_bytes(model) / param_bytes(full)


def test_full_state_dict_round_trip_and_memory_per_rank():
    ratios = run_workers(_state_and_memory, 4)
    assert max(ratios) <= 0.3, ratios


def _stage(rank, world):
    gpt = make_gpt(recompute=True)
    stage = apply_tensor_parallel(nn.Sequential(*list(gpt)[1:]), None)  # a last pipeline stage
    h = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    _, y = make_batches(1)[0]
    loss = tp_loss(stage(h), y, None)
    loss.backward()
    torch.optim.SGD(stage.parameters(), lr=0.1).step()
    return loss.detach(), h.grad, full_state_dict(stage, None)


def test_pipeline_stage_slice_with_recompute():
    ref = nn.Sequential(*list(make_gpt(recompute=True))[1:])
    h = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    _, y = make_batches(1)[0]
    loss = full_loss(ref(h), y)
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for tp_loss_value, grad, state in run_workers(_stage, 2):
        assert_close(tp_loss_value, loss.detach())
        assert_close(grad, h.grad)
        for key, value in ref.state_dict().items():
            assert_close(state[key], value)


def _bad_tp(rank, world):
    with pytest.raises(UserError, match=r"tp=3 does not divide n_heads=4; choose tp in \{1, 2, 4\}"):
        apply_tensor_parallel(make_gpt(), None)
    return True


def _count_all_reduces(rank, world):
    stage = apply_tensor_parallel(nn.Sequential(*list(make_gpt())[1:3]), None)  # two blocks
    h = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        out = stage(h)
        forward = len(calls)
        out.sum().backward()
    finally:
        dist.all_reduce = real
    return forward, len(calls) - forward


def test_two_all_reduces_forward_and_two_backward_per_block():
    for counts in run_workers(_count_all_reduces, 2):
        assert counts == (4, 4)


def test_tp_that_does_not_divide_heads_raises():
    assert all(run_workers(_bad_tp, 3))


def _dp_tp(rank, world):
    groups = Topology(dp=2, tp=2).init_groups()
    model = apply_tensor_parallel(make_gpt(), groups.tp_group)
    engine = DataParallel(model, group=groups.dp_group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    half = BATCH // 2
    losses = []
    for x, y in make_batches():
        mine = slice(groups.dp_rank * half, (groups.dp_rank + 1) * half)
        loss = tp_loss(engine(x[mine]), y[mine], groups.tp_group)  # mean over this half
        loss.backward()
        engine.step(optimizer)  # averages gradients over dp: the global mean gradient
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.dp_group)
        losses.append(total.item() / 2)
    return losses, full_state_dict(model, groups.tp_group)


def test_dp2_tp2_equals_single_process():
    ref_losses, ref_state = reference("adam", make_batches())
    for losses, state in run_workers(_dp_tp, 4):
        assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert_same_parameters(state, ref_state, "adam")

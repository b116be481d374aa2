"""Weights synced from the tp group's first rank, and sequence parallelism equal to one process.

An unseeded model (different weights on every rank) split by a plan trains as one process from rank 0's
weights; a sequence-parallel plan (norms on a share of the sequence, all-gathers and reduce-scatters for
the all-reduces) on a user's transformer and on the zoo GPT gives one process's losses, gradients and
parameters.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config.errors import UserError
from paraloom.models.gpt import GPT, SEQUENCE_TP_PLAN
from paraloom.tensor_parallel import (
    apply_tensor_parallel,
    apply_tp_plan,
    check_tp_plan,
    full_state_dict,
    trace_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from paraloom.tensor_parallel.layouts import GradAllReduce
from paraloom.trace.timeline import Timeline

SEQ, VOCAB, D, HEADS, BATCH, STEPS = 8, 32, 16, 4, 2, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        qkv = self.qkv(x)  # under sequence parallelism x holds a share of the sequence, qkv all of it
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """A user's transformer; its norms start from random weights, a float64 buffer scales the embedding."""

    def __init__(self, n_layers=2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.register_buffer("scale", 1 + torch.rand((), dtype=torch.float64))
        self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):  # not ones and zeros: a norm's gradient scale shows in its weight
                nn.init.normal_(m.weight, 1.0, 0.2)
                nn.init.normal_(m.bias, 0.0, 0.2)

    def forward(self, idx):
        x = self.emb(idx) * self.scale.float()
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "emb": "vocab",
    "blocks.*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads"},
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "head": "colwise",
}
SP_PLAN = {
    "emb": {"style": "vocab", "output": "sequence"},
    "blocks.*.ln?": "sequence",
    "blocks.*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads", "input": "sequence"},
    "blocks.*.attn.proj": {"style": "rowwise", "output": "sequence"},
    "blocks.*.mlp.fc": {"style": "colwise", "input": "sequence"},
    "blocks.*.mlp.proj": {"style": "rowwise", "output": "sequence"},
    "norm": "sequence",
    "head": {"style": "colwise", "input": "sequence"},
}


def batches(vocab=VOCAB, seq=SEQ):
    tokens = torch.randint(0, vocab, (STEPS, BATCH, seq + 1), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def full_grads(model, group=None):
    """The unsplit gradients, keyed like the state dict."""
    params = dict(model.named_parameters())
    saved = {name: p.data for name, p in params.items()}
    for p in params.values():
        p.data = p.grad
    try:
        return {k: v for k, v in full_state_dict(model, group).items() if k in params}
    finally:
        for name, p in params.items():
            p.data = saved[name]


def train(model, loss_fn, data):
    """Losses, the first step's unsplit gradients and the final unsplit state after SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for x, y in data:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = grads if grads is not None else full_grads(model)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads, full_state_dict(model, None)


def sharded_loss(logits, y):
    return vocab_parallel_cross_entropy(logits, y, None)


def full_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def assert_same(result, ref):
    for got, want, what in zip(result, ref, ("losses", "grads", "state"), strict=True):
        if isinstance(want, dict):
            assert got.keys() == want.keys()
            for key in want:
                assert_close(got[key], want[key], msg=lambda m, key=key, what=what: f"{what} {key}: {m}")
        else:
            assert_close(got, want, msg=lambda m, what=what: f"{what}: {m}")


def _unseeded(rank, world):
    torch.manual_seed(100 + rank)  # every rank builds other weights, as a script without a seed would
    model = LM()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    calls = Counter()
    broadcast = dist.broadcast

    def counted(tensor, *args, **kwargs):
        calls[tensor.dtype] += 1
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counted
    try:
        apply_tp_plan(model, TP_PLAN, None)
    finally:
        dist.broadcast = broadcast
    assert calls == {torch.float32: 1, torch.float64: 1}  # one flattened broadcast per dtype
    result = train(model, sharded_loss, batches())

    torch.manual_seed(100 + rank)
    kept = apply_tp_plan(LM(), TP_PLAN, None, sync_weights=False)
    return start, result, kept.blocks[0].attn.proj.bias.detach(), kept.scale


def test_unseeded_ranks_train_as_one_process_from_rank_0s_weights():
    results = run_workers(_unseeded, 2)
    starts = [r[0] for r in results]
    assert not torch.equal(starts[0]["blocks.0.ln1.weight"], starts[1]["blocks.0.ln1.weight"])
    ref_model = LM()
    ref_model.load_state_dict(starts[0])
    ref = train(ref_model, full_loss, batches())
    for _, result, _, _ in results:
        assert_same(result, ref)
    for key, value in results[0][1][2].items():  # replicated and gathered tensors equal on both ranks
        assert torch.equal(value, results[1][1][2][key]), key
    # sync_weights=False leaves each rank its own replicated tensors
    assert not torch.equal(results[0][2], results[1][2]) and not torch.equal(results[0][3], results[1][3])


def _sequence_parallel(rank, world):
    torch.manual_seed(0)
    model = apply_tp_plan(LM(), SP_PLAN, None)
    lengths = []
    model.blocks[0].ln1.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    result = train(model, sharded_loss, batches())
    assert lengths == [SEQ // world] * STEPS  # the norm saw this rank's share of the sequence
    return result


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_plan_equals_one_process(tp):
    torch.manual_seed(0)
    ref = train(LM(), full_loss, batches())
    for result in run_workers(_sequence_parallel, tp):
        assert_same(result, ref)


def make_gpt():
    torch.manual_seed(0)
    return GPT((SEQ,), 64, n_layers=2, d_model=D, n_heads=HEADS)


def _gpt(rank, world):
    gpt = make_gpt()
    gpt.tp_plan = SEQUENCE_TP_PLAN
    model = apply_tensor_parallel(gpt, None)
    timeline = Timeline(rank)
    assert trace_tensor_parallel(model, timeline) == 16  # 10 layers, 5 sequence-parallel norms, 1 layout
    timeline.active = True
    first = train(model, sharded_loss, batches(64)[:1])
    timeline.active = False
    names = Counter(e["name"] for e in timeline.to_chrome()["traceEvents"] if e["ph"] == "X")
    return first, names


def test_gpt_sequence_plan_equals_one_process_and_is_traced():
    ref = train(make_gpt(), full_loss, batches(64)[:1])
    for result, names in run_workers(_gpt, 2):
        assert_same(result, ref)
        assert names == {
            "all_gather g forward": 5,  # into qkv and fc of 2 blocks, into the head
            "reduce_scatter g-bar forward": 5,  # out of the embedding, and both proj of 2 blocks
            "all_gather backward": 1,  # the position embedding's cut
            "reduce_scatter g backward": 5,
            "all_gather g-bar backward": 5,
            "all_reduce f backward": 4,  # the proj biases, summed from the rank's positions
            "all_reduce sequence-parallel grad backward": 10,  # weight and bias of 5 norms
        }


def test_sequence_modules_are_refused_around_split_layers_and_with_shared_weights():
    with torch.device("meta"):
        model = LM()
    with pytest.raises(UserError, match=r"^module 'blocks\.0' is sequence-parallel \(whole, on a share of "
                                        r"the sequence\) but holds 'blocks\.0\.attn\.qkv' \(colwise\); "
                                        r"mark its norms"):
        check_tp_plan(model, {**SP_PLAN, "blocks.*": "sequence"}, 2)
    model.blocks[1].ln1.weight = model.blocks[0].ln1.weight
    with pytest.raises(UserError, match=r"^a parameter of module 'blocks\.0\.ln1' is shared with another "
                                        r"module"):
        check_tp_plan(model, SP_PLAN, 2)
    hooked = LM()
    GradAllReduce(None).attach(hooked.norm)
    with pytest.raises(UserError, match=r"^module 'norm' has tensor-parallel hooks already: apply the tp "
                                        r"plan once$"):
        check_tp_plan(hooked, SP_PLAN, 2)

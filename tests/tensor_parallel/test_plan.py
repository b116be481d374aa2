"""A tp plan splits a user's own transformer exactly (TP 2 and 4 equal one process); bad plans are refused."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config.errors import UserError
from paraloom.models.gpt import GPT, TP_PLAN
from paraloom.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    apply_tp_plan,
    check_tp_plan,
    full_state_dict,
    is_tp_sharded,
    load_full_state_dict,
    vocab_parallel_cross_entropy,
)

SEQ, VOCAB, D, HEADS, BATCH, STEPS = 8, 64, 32, 4, 4, 3


class HeadsAttention(nn.Module):
    """Causal attention reading its head count from `self.n_heads` (the plan divides it by tp)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.qkv = nn.Linear(D, 3 * D)  # rows laid out (3, n_heads, head_dim)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class WidthAttention(HeadsAttention):
    """Causal attention deriving its head count from the width its qkv projection hands it."""

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class TinyBlock(nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D), attention()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A user's language model: not a paraloom zoo model, not an nn.Sequential of pieces."""

    def __init__(self, attention=HeadsAttention, n_layers=2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(TinyBlock(attention) for _ in range(n_layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


PLAN = {
    "emb": "vocab",
    "blocks.*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads"},
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "blocks.*.ln?": "replicate",
    "norm": "replicate",
    "head": "colwise",
}
WIDTH_PLAN = {**PLAN, "blocks.*.attn.qkv": {"style": "colwise", "fused": 3}}


def make_model(attention=HeadsAttention, seed=0):
    torch.manual_seed(seed)
    return TinyLM(attention)


def make_batches():
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def full_grads(model):
    """The unsplit gradients, keyed like the state dict (full_state_dict over the .grad tensors)."""
    params = dict(model.named_parameters())
    saved = {name: p.data for name, p in params.items()}
    for p in params.values():
        p.data = p.grad
    try:
        return full_state_dict(model, None)
    finally:
        for name, p in params.items():
            p.data = saved[name]


def train(model, optimizer_name, loss_fn):
    """Losses, the first step's gradients and the final state dict after STEPS steps."""
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    losses, grads = [], None
    for x, y in make_batches():
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = grads if grads is not None else full_grads(model)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads, full_state_dict(model, None)


def sharded_loss(logits, y):
    assert is_tp_sharded(logits), "the colwise head's logits are vocabulary-sharded"
    return vocab_parallel_cross_entropy(logits, y, None)


def full_loss(logits, y):
    assert not is_tp_sharded(logits)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _train_plan(rank, world, attention, plan, optimizers):
    out = {}
    for name in optimizers:
        model = apply_tp_plan(make_model(attention), plan, None)
        attn = model.blocks[0].attn
        assert isinstance(attn.qkv, ColumnParallelLinear) and isinstance(attn.proj, RowParallelLinear)
        assert isinstance(model.emb, VocabParallelEmbedding) and isinstance(model.head, ColumnParallelLinear)
        assert attn.n_heads == (HEADS // world if "heads" in plan["blocks.*.attn.qkv"] else HEADS)
        out[name] = train(model, name, sharded_loss)
    return out


def assert_same(state, ref, name):
    for key, value in ref.items():
        mine = state[key]
        if name == "adam" and key.endswith("attn.qkv.bias"):
            # the key bias's true gradient is exactly zero (softmax ignores a shift shared by all
            # keys): its rounding noise is turned into full steps by Adam. Compare q and v.
            keep = torch.cat([torch.arange(D), torch.arange(2 * D, 3 * D)])
            mine, value = mine[keep], value[keep]
        assert_close(mine, value, msg=lambda m, key=key: f"{name} {key}: {m}")


@pytest.mark.parametrize("attention, plan, tp, optimizers", [
    (HeadsAttention, PLAN, 2, ("sgd", "adam")),
    (HeadsAttention, PLAN, 4, ("adam",)),
    (WidthAttention, WIDTH_PLAN, 2, ("sgd",)),
], ids=["heads-tp2", "heads-tp4", "width-tp2"])
def test_plan_training_equals_single_process(attention, plan, tp, optimizers):
    results = run_workers(_train_plan, tp, attention, plan, optimizers)
    for name in optimizers:
        ref_losses, ref_grads, ref_state = train(make_model(attention), name, full_loss)
        for rank_result in results:
            losses, grads, state = rank_result[name]
            assert_close(losses, ref_losses)
            assert_same(grads, ref_grads, "grad")
            assert_same(state, ref_state, name)


def _gpt_by_plan(rank, world):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    by_plan = apply_tp_plan(GPT((16,), 256, n_layers=2, d_model=32, n_heads=4), GPT.tp_plan, None)
    torch.manual_seed(0)
    by_gpt = apply_tensor_parallel(GPT((16,), 256, n_layers=2, d_model=32, n_heads=4), None)
    logits = by_plan(x)
    assert is_tp_sharded(logits) and logits.shape[-1] == 256 // world
    assert_close(logits, by_gpt(x))
    state = full_state_dict(by_plan, None)
    load_full_state_dict(by_gpt, state)  # a fused layer's shards go back where they came from
    assert_close(by_gpt(x), logits)
    return logits.detach(), state


def test_gpt_plan_matches_apply_tensor_parallel_and_one_process():
    torch.manual_seed(0)
    ref = GPT((16,), 256, n_layers=2, d_model=32, n_heads=4)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    full = ref(x)
    for rank, (logits, state) in enumerate(run_workers(_gpt_by_plan, 2)):
        assert_close(logits, full[..., rank * 128:(rank + 1) * 128])
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value), key


def _refused_untouched(rank, world):
    model = make_model()
    with pytest.raises(UserError, match=r"^module 'blocks\.0\.attn\.qkv': tp=3 does not divide n_heads=4; "
                                        r"choose tp in \{1, 2, 4\}$"):
        apply_tp_plan(model, PLAN, None)
    assert type(model.emb) is nn.Embedding and type(model.head) is nn.Linear  # nothing touched
    assert model.blocks[0].attn.n_heads == HEADS
    return True


def test_tp_not_dividing_heads_refused_before_anything_changes():
    assert all(run_workers(_refused_untouched, 3))


def test_stage_slice_not_strict():
    stage = nn.Sequential(*list(GPT((16,), 256, n_layers=2, d_model=32, n_heads=4))[1:])
    with pytest.raises(UserError, match=r"tp_plan pattern '\*\.tok' matches no module"):
        check_tp_plan(stage, TP_PLAN, 2)
    check_tp_plan(stage, TP_PLAN, 2, strict=False)
    assert apply_tp_plan(stage, TP_PLAN, None, strict=False) is stage  # one process: nothing to split


@pytest.mark.parametrize("plan, tp, message", [
    ({**PLAN, "blocks.*.attn.qkvv": "colwise"},
     2, r"^tp_plan pattern 'blocks\.\*\.attn\.qkvv' matches no module of the model; "
        r"its modules include: emb, blocks\.0\.attn\.qkv, .*$"),
    ({"emb": "colwise"}, 2, r"^tp_plan entry 'emb' \(colwise\) needs an nn\.Linear, but module 'emb' is an "
                            r"Embedding$"),
    ({"head": "vocab"}, 2, r"^tp_plan entry 'head' \(vocab\) needs an nn\.Embedding, but module 'head' is "
                           r"a Linear$"),
    ({"head": "colwise"}, 3, r"^module 'head': tp=3 does not divide out_features=64; choose tp in \{1, 2, 4, "
                             r"8, 16, 32, 64\}$"),
    ({"blocks.0.mlp.2": "rowwise"}, 5, r"^module 'blocks\.0\.mlp\.2': tp=5 does not divide in_features=64; "),
    ({"emb": "vocab", "head": "rowwise"}, 64, r"^module 'head': tp=64 does not divide in_features=32; "
                                               r"choose tp in \{1, 2, 4, 8, 16, 32\}$"),
    ({"blocks.*.attn.qkv": {"style": "colwise", "fused": 3}}, 64,
     r"^module 'blocks\.0\.attn\.qkv': tp=64 does not divide out_features/3=32; "),
    ({"head": "columnwise"}, 2, r"^tp_plan entry 'head': unknown style 'columnwise'; "
                                r"choose one of colwise, rowwise, vocab, replicate, sequence, prepare$"),
    ({"head": {"style": "colwise", "gather": True}}, 2,
     r"^tp_plan entry 'head': unknown key 'gather'; the keys are style, fused, heads, input, output, "
     r"desired_input, desired_output, sequence_dim$"),
    ({"blocks.*.attn.proj": {"style": "rowwise", "heads": "n_heads"}}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn\.proj': fused and heads describe a colwise layer's output"),
    ({"blocks.*.attn.qkv": {"style": "colwise", "heads": "n_head"}}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn\.qkv': heads='n_head' must name a positive int attribute of module "
     r"'blocks\.0\.attn'"),
    ({"blocks.*.attn.*": "colwise", "blocks.*.attn.proj": "rowwise"}, 2,
     r"^module 'blocks\.0\.attn\.proj' matches tp_plan entries 'blocks\.\*\.attn\.\*' \(colwise\) and "
     r"'blocks\.\*\.attn\.proj' \(rowwise\)"),
    # layouts: which each layer takes and gives, a prepare entry's pairs, the sequence dimension
    ({"head": {"style": "colwise", "input": "shard"}}, 2,
     r"^tp_plan entry 'head': a colwise layer's input is replicate or sequence, not 'shard'$"),
    ({"head": {"style": "rowwise", "output": "shard"}}, 2,
     r"^tp_plan entry 'head': a rowwise layer's output is replicate or sequence, not 'shard'$"),
    ({"emb": {"style": "vocab", "input": "sequence"}}, 2,
     r"^tp_plan entry 'emb': a vocab layer's input is replicate, not 'sequence'$"),
    ({"head": {"style": "colwise", "output": "columns"}}, 2,
     r"^tp_plan entry 'head': output='columns' is not a layout; give one of replicate, shard, sequence$"),
    ({"head": {"style": "colwise", "desired_output": "replicate"}}, 2,
     r"^tp_plan entry 'head': desired_output belongs to a prepare entry; a colwise layer takes input and "
     r"output"),
    ({"norm": {"style": "sequence", "input": "sequence"}}, 2,
     r"^tp_plan entry 'norm': input does not apply to a sequence module, which takes its input as it "
     r"arrives; "),
    ({"blocks.*.attn": "prepare"}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn': a prepare entry needs input and desired_input, or output and "
     r"desired_output$"),
    ({"blocks.*.attn": {"style": "prepare", "input": "sequence"}}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn': give input and desired_input together .*; desired_input is "
     r"missing$"),
    ({"blocks.*.attn": {"style": "prepare", "input": ["sequence", None],
                        "desired_input": ["replicate", "shard"]}}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn': input=\['sequence', None\] and desired_input=\['replicate', "
     r"'shard'\] must list the same inputs, null at the same places$"),
    ({"blocks.*.attn": {"style": "prepare", "output": [], "desired_output": []}}, 2,
     r"^tp_plan entry 'blocks\.\*\.attn': output=\[\] is not a layout; give one of replicate, shard, "
     r"sequence or a list of them \(null: left alone\)$"),
    ({"head": {"style": "colwise", "sequence_dim": 0}}, 2,
     r"^tp_plan entry 'head': sequence_dim=0 applies to a sequence layout, and this entry has none$"),
    ({"head": {"style": "colwise", "input": "sequence", "sequence_dim": True}}, 2,
     r"^tp_plan entry 'head': sequence_dim=True must be an integer"),
])
def test_bad_plans_refused_in_one_line_on_the_meta_device(plan, tp, message):
    with torch.device("meta"):
        model = TinyLM()
    with pytest.raises(UserError, match=message) as refused:
        check_tp_plan(model, plan, tp)
    assert "\n" not in str(refused.value)


def test_good_plans_pass_on_the_meta_device_without_a_process_group():
    with torch.device("meta"):
        model, gpt = TinyLM(), GPT((16,), 256, n_layers=2, d_model=32, n_heads=4)
    for tp in (1, 2, 4):
        check_tp_plan(model, PLAN, tp)
        check_tp_plan(gpt, gpt.tp_plan, tp)
    assert model.blocks[0].attn.n_heads == HEADS and type(model.head) is nn.Linear


def test_a_split_model_and_tied_weights_are_refused():
    model = make_model()
    model.blocks[0].attn.qkv = ColumnParallelLinear.from_linear(model.blocks[0].attn.qkv)
    with pytest.raises(UserError, match=r"^module 'blocks\.0\.attn\.qkv' is a ColumnParallelLinear already"):
        apply_tp_plan(model, PLAN)
    tied = make_model()
    tied.head.weight = tied.emb.weight
    with pytest.raises(UserError, match=r"^the weight of module 'emb' is shared with another module"):
        check_tp_plan(tied, PLAN, 2)


def test_is_tp_sharded_marks_colwise_outputs_only():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    colwise = ColumnParallelLinear.from_linear(nn.Linear(8, 4))
    out = colwise(x)
    assert is_tp_sharded(out)
    assert not is_tp_sharded(out.view(2, 3, 4)) and not is_tp_sharded(out * 1)
    assert not is_tp_sharded(ColumnParallelLinear.from_linear(nn.Linear(8, 4), gather_output=True)(x))
    assert not is_tp_sharded(RowParallelLinear.from_linear(nn.Linear(8, 4))(x))
    assert not is_tp_sharded(nn.Linear(8, 4)(x)) and not is_tp_sharded(x) and not is_tp_sharded(None)

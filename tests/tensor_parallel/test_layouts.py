"""Layer input and output layouts and module input layouts (torch's input_layouts, output_layouts and
PrepareModuleInput), each equal to one process; torch's example plans translated to paraloom's."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.tensor_parallel import ColumnParallelLinear, apply_tp_plan, full_state_dict, is_tp_sharded

ROWS, STEPS = 20, 3


class ToyModel(nn.Module):
    """pytorch/examples' distributed/tensor_parallelism toy MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


# torch plan -> paraloom plan; "rows" says whether each rank gets every input row or its share of them
TOY_PLANS = {
    # tensor_parallel_example.py: {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    "tensor_parallel_example": ({"in_proj": "colwise", "out_proj": "rowwise"}, "all"),
    # sequence_parallel_example.py: ColwiseParallel(input_layouts=Shard(0)),
    # RowwiseParallel(output_layouts=Shard(0))
    "sequence_parallel_example": ({"in_proj": {"style": "colwise", "input": "sequence", "sequence_dim": 0},
                                   "out_proj": {"style": "rowwise", "output": "sequence", "sequence_dim": 0}},
                                  "share"),
    # ColwiseParallel(output_layouts=Replicate()), out_proj left whole
    "colwise_replicated": ({"in_proj": {"style": "colwise", "output": "replicate"}}, "all"),
    # ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate())
    "colwise_replicated_rowwise": ({"in_proj": {"style": "colwise", "output": "replicate"},
                                    "out_proj": {"style": "rowwise", "input": "replicate"}}, "all"),
}


def toy_inputs():
    return torch.rand(STEPS, ROWS, 10, generator=torch.Generator().manual_seed(1))


def toy_train(model, inputs):
    """Losses (summed over rows, so the ranks' shares add up), first gradients, final unsplit state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], None
    for x in inputs:
        loss = (model(x) ** 2).sum() / ROWS
        opt.zero_grad()
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads, full_state_dict(model, None)


def _toy(rank, world):
    out = {}
    for name, (plan, rows) in TOY_PLANS.items():
        torch.manual_seed(0)
        model = apply_tp_plan(ToyModel(), plan, None)
        x = toy_inputs()
        if rows == "share":
            x = x.chunk(world, dim=1)[rank]
        gathered = name.startswith("colwise_replicated")
        assert isinstance(model.in_proj, ColumnParallelLinear) and model.in_proj.gather_output == gathered
        assert is_tp_sharded(model.in_proj(x[0])) != gathered
        out[name] = toy_train(model, x)
    return out


def test_torch_example_plans_and_replicated_colwise_output_equal_one_process():
    torch.manual_seed(0)
    ref_model = ToyModel()
    ref_losses, ref_grads, ref_state = toy_train(ref_model, toy_inputs())
    results = run_workers(_toy, 2)
    for name, (_, rows) in TOY_PLANS.items():
        losses = [r[name][0] for r in results]
        total = sum(losses) if rows == "share" else losses[0]  # a share of the rows each: their losses add up
        assert_close(total, ref_losses, msg=lambda m, n=name: f"{n}: {m}")
        for r in results:
            assert_close(r[name][2], ref_state, msg=lambda m, n=name: f"{n}: {m}")
            # a whole parameter's gradient is whole on every rank; a split one is compared through the state
            for key, grad in r[name][1].items():
                if grad.shape == ref_grads[key].shape:
                    assert_close(grad, ref_grads[key], msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


VOCAB, D, HEADS, SEQ, BATCH = 32, 16, 4, 8, 2


class Attention(nn.Module):
    """Llama's attention in fsdp_tp_example.py's llama2_model, separate q, k, v projections; `positions`
    stands in for the rotary frequencies its forward also takes."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, positions):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q + positions[:t], k + positions[:t], v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False), \
            nn.Linear(D, 2 * D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D), FeedForward()

    def forward(self, x, positions):
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(2))
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)
        self.register_buffer("positions", torch.randn(SEQ, D // HEADS) * 0.1)
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                nn.init.normal_(m.weight, 1.0, 0.2)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.positions)
        return self.output(self.norm(h))


# fsdp_tp_example.py's plan: its parallelize_module calls on the model and on each block, as one plan
FSDP_TP_PLAN = {
    # RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    "tok_embeddings": {"style": "vocab", "input": "replicate", "output": "sequence"},
    "norm": "sequence",  # SequenceParallel()
    "output": {"style": "colwise", "input": "sequence", "output": "replicate"},
    "layers.*.attention_norm": "sequence",
    # PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    "layers.*.attention": {"style": "prepare", "input": ["sequence", None],
                           "desired_input": ["replicate", None]},
    "layers.*.attention.wq": {"style": "colwise", "heads": "n_heads"},  # heads: its n_heads // tp by hand
    "layers.*.attention.wk": {"style": "colwise", "heads": "n_heads"},
    "layers.*.attention.wv": {"style": "colwise", "heads": "n_heads"},
    "layers.*.attention.wo": {"style": "rowwise", "output": "sequence"},
    "layers.*.ffn_norm": "sequence",
    "layers.*.feed_forward": {"style": "prepare", "input": "sequence", "desired_input": "replicate"},
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": {"style": "rowwise", "output": "sequence"},
    "layers.*.feed_forward.w3": "colwise",
}


def lm_batches():
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def lm_train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for x, y in lm_batches():
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads, full_state_dict(model, None)


def _fsdp_tp(rank, world):
    torch.manual_seed(0)
    model = apply_tp_plan(Transformer(), FSDP_TP_PLAN, None)
    assert model.layers[0].attention.n_heads == HEADS // world
    seen = []
    attention = model.layers[0].attention
    attention.register_forward_hook(lambda m, args, out: seen.append((args[0].shape, out.shape)))
    result = lm_train(model)
    assert seen[0] == ((BATCH, SEQ, D), (BATCH, SEQ // world, D))  # gathered in, reduce-scattered out

    torch.manual_seed(0)
    two = {"style": "prepare", "input": ["sequence", "sequence"], "desired_input": ["replicate", "replicate"]}
    wrong = apply_tp_plan(Transformer(), {**FSDP_TP_PLAN, "layers.*.feed_forward": two}, None)
    with pytest.raises(ValueError, match=r"^module 'layers\.0\.feed_forward': its tp_plan entry lays out "
                                         r"2 inputs and it has 1 here; give one layout \(or null\) per "
                                         r"positional input$"):
        wrong(lm_batches()[0][0])
    with pytest.raises(ValueError, match=r"^dimension 1 of a \(2, 7, 16\) tensor does not split evenly over "
                                         r"2 tensor-parallel ranks; make its size a multiple of 2$"):
        model(lm_batches()[0][0][:, :7])
    return result


def test_fsdp_tp_example_plan_with_module_input_layouts_equals_one_process():
    torch.manual_seed(0)
    ref_losses, ref_grads, ref_state = lm_train(Transformer())
    for losses, grads, state in run_workers(_fsdp_tp, 2):
        assert_close(losses, ref_losses)
        assert_close(state, ref_state)
        for key, grad in grads.items():  # the whole ones (norms): summed over the ranks' positions
            if grad.shape == ref_grads[key].shape:
                assert_close(grad, ref_grads[key], msg=lambda m, key=key: f"{key}: {m}")

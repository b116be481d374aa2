"""Your own model and data set, trained by paraloom: a small transformer language model on text.

The model is not an nn.Sequential and not paraloom's gpt. It takes part in every kind of
parallelism through two small declarations:

- `pipeline_pieces()` lists the modules forward runs in order (embedding, blocks, head); pipeline
  and layer parallelism place whole pieces on stages.
- `tp_plan` maps module-name patterns to how tensor parallelism splits each layer (Megatron-style:
  the fused q/k/v projection and the first MLP layer by columns, the layers after them by rows, the
  embedding and the output layer by vocabulary). examples/user_text.yaml spells the same plan out
  under model.tp_plan; without one there, paraloom takes the model's attribute.

    PYTHONPATH=examples paraloom train examples/user_text.yaml --nproc 2
    PYTHONPATH=examples paraloom train examples/user_text.yaml --nproc 2 --set parallel.tp=2
    PYTHONPATH=examples paraloom train examples/user_text.yaml --nproc 2 --set parallel.pp=2

The data set is paraloom's built-in byte-level text corpus (the standard library's own source),
wrapped in a map-style Dataset of (input bytes, next bytes) pairs.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from paraloom.data import DataSets, load_text

VOCAB = 256  # bytes

# module-name pattern -> split; `*` is one name atom ("blocks.*.attn.qkv": every block's qkv)
TP_PLAN = {
    "embed.tok": "vocab",
    "blocks.*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads"},  # q, k, v stacked
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "head.out": "colwise",  # vocabulary-sharded logits, for the vocabulary-parallel loss
}


class Embed(nn.Module):
    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > len(self.pos):
            raise ValueError(f"sequences of {idx.shape[1]} tokens exceed max_len={len(self.pos)}")
        return self.tok(idx) + self.pos[: idx.shape[1]]


class SelfAttention(nn.Module):
    """Causal self-attention over `n_heads` heads. Under tensor parallelism the plan gives each rank
    its share of the heads and divides `n_heads` accordingly; forward derives the rest from it."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)  # rows laid out (q|k|v, head, head_dim)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), SelfAttention(d_model, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # return the logits as the layer gives them: no view or copy


class TinyTransformer(nn.Module):
    """(B, T) bytes -> (B, T, 256) next-byte logits."""

    tp_plan = TP_PLAN

    def __init__(self, d_model: int, n_heads: int, n_layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = Embed(d_model, max_len)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.head = Head(d_model)

    def pipeline_pieces(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for piece in self.pipeline_pieces():
            x = piece(x)
        return x


def make_model(d_model: int = 128, n_heads: int = 4, n_layers: int = 2, max_len: int = 64) -> TinyTransformer:
    if d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}")
    return TinyTransformer(d_model, n_heads, n_layers, max_len)


class NextBytes(Dataset):
    """A map-style data set: sample i is (seq_len bytes, the seq_len bytes one step later), int64."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


def make_data(seq_len: int = 64, text_bytes: int = 200_000) -> DataSets:
    """About `text_bytes` of Python source to train on, a tenth as much from other files to evaluate."""
    split = load_text(seq_len=seq_len, text_bytes=text_bytes)
    return DataSets(NextBytes(split.x_train, split.y_train), NextBytes(split.x_test, split.y_test),
                    loss="next_token", n_classes=VOCAB)

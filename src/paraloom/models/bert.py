"""BERT (Devlin et al. 2019): a bidirectional transformer encoder with its masked-language-model
head, laid out as a sequence of pieces `[Embeddings, Layer, ..., Layer, MLMHead]`.

As the paper (and Hugging Face's `BertForMaskedLM`) builds it: token, position and segment
embeddings summed and layer-normed; post-norm layers (attention, add, norm; a GELU MLP 4x wide,
add, norm); the head's dense GELU transform and norm, then logits through the token embedding's
own weight plus a bias. `bert:layers=24,hidden=1024,heads=16,seq=512,vocab=30522` is BERT-large:
335,174,458 parameters (the paper's "340M"; its encoder with the pooler, 335,141,888, is the count
usually quoted; the masked-LM head has no pooler). Logits are (B, T, vocab) for every position.
It is here for the planner and for throughput runs: `paraloom train` would give it the text data's
next-byte targets, which an encoder sees, so what it learns there means nothing. No dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paraloom.config.errors import UserError

LN_EPS = 1e-12  # BERT's layer-norm epsilon
INIT_STD = 0.02  # its weights' initial standard deviation


class Embeddings(nn.Module):
    """Token + position + segment (all segment 0) embeddings, layer-normed: (B, T) -> (B, T, d)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.seg = nn.Embedding(2, d_model)
        self.ln = nn.LayerNorm(d_model, eps=LN_EPS)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.ln(self.tok(idx) + self.pos(positions) + self.seg.weight[0])


class Layer(nn.Module):
    """Post-norm encoder layer: bidirectional attention, then a GELU MLP, each added and normed."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise UserError(f"the bert's hidden={d_model} must be a multiple of heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln1 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model, eps=LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(a))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))


class MLMHead(nn.Module):
    """Dense GELU transform, norm, then logits through the (tied) token embedding plus a bias."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        vocab_size, d_model = embedding.weight.shape
        self.dense = nn.Linear(d_model, d_model)
        self.ln = nn.LayerNorm(d_model, eps=LN_EPS)
        self.embedding = embedding  # shared with the first piece
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(F.gelu(self.dense(x))), self.embedding.weight, self.bias)


class BERT(nn.Sequential):
    """`BERT((seq_len,), vocab_size, n_layers=, d_model=, n_heads=)`: (B, T) tokens -> (B, T, vocab)."""

    shard_units = ("Layer",)  # parallel.shard's units; the tied embedding stays with the root

    def __init__(self, input_shape: tuple[int, ...], n_classes: int = 256, *, n_layers: int = 4,
                 d_model: int = 128, n_heads: int = 4, **_: object) -> None:
        if len(input_shape) != 1:
            raise UserError(f"the bert takes token sequences shaped (seq_len,), got {input_shape}")
        embeddings = Embeddings(n_classes, input_shape[0], d_model)
        super().__init__(embeddings, *(Layer(d_model, n_heads) for _ in range(n_layers)),
                         MLMHead(embeddings.tok))
        for module in self.modules():  # BERT's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)


__all__ = ["BERT"]

"""GPT: a decoder-only transformer (byte-level by default), laid out as a sequence of pieces.

`GPT` is an `nn.Sequential` of `[Embedding, Block, ..., Block, Head]`, so plain model parallelism
and pipeline stages are slices of it, and tensor parallelism rewrites the blocks in place.
The attention's fused `qkv` projection has output rows laid out as (3, n_heads, head_dim):
all query heads, then all key heads, then all value heads. No dropout: runs are deterministic.
`TP_PLAN` (also `GPT.tp_plan`) says how tensor parallelism splits it; its patterns start with `*`
so they match the whole GPT and any pipeline stage of it (an nn.Sequential of its pieces) alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paraloom.errors import UserError

# module-name pattern -> tensor-parallel style (tensor_parallel/plan.py; Shoeybi et al. 2019, figure 3)
TP_PLAN: dict[str, Any] = {
    "*.tok": "vocab",  # token embedding: vocabulary ranges
    "*.pos": "replicate",
    "*.ln*": "replicate",  # layer norms
    "*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads"},  # each rank its heads of q, k, v
    "*.attn.proj": "rowwise",
    "*.mlp.fc": "colwise",
    "*.mlp.proj": "rowwise",
    "*.out": "colwise",  # vocabulary-sharded logits, for the vocabulary-parallel loss
}


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding: (B, T) bytes -> (B, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    """Causal multi-head self-attention; `n_heads` is the number of heads this module computes."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block; with `recompute` its activations are recomputed in backward."""

    def __init__(self, d_model: int, n_heads: int, *, recompute: bool = False) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), Attention(d_model, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(d_model), FeedForward(d_model)
        self.recompute = recompute

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Head(nn.Module):
    """Final layer norm and the language-model head: (B, T, d_model) -> (B, T, vocab) logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Sequential):
    """`GPT((seq_len,), vocab_size, n_layers=, d_model=, n_heads=, recompute=)`: logits (B, T, vocab)."""

    tp_plan: ClassVar[dict[str, Any]] = TP_PLAN

    def __init__(self, input_shape: tuple[int, ...], n_classes: int = 256, *, n_layers: int = 4,
                 d_model: int = 128, n_heads: int = 4, recompute: bool = False, **_: object) -> None:
        if len(input_shape) != 1:
            raise UserError(f"the gpt needs token sequences shaped (seq_len,), got {input_shape}: "
                            "use data.name=text")
        if d_model % n_heads:
            options = [h for h in range(1, d_model + 1) if d_model % h == 0]
            raise UserError(f"model.n_heads={n_heads} does not divide model.d_model={d_model}; "
                            f"choose n_heads in {{{', '.join(map(str, options))}}}")
        super().__init__(Embedding(n_classes, input_shape[0], d_model),
                         *(Block(d_model, n_heads, recompute=recompute) for _ in range(n_layers)),
                         Head(d_model, n_classes))
        self.seq_len, self.vocab_size, self.n_layers = input_shape[0], n_classes, n_layers
        self.d_model, self.n_heads = d_model, n_heads

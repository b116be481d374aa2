"""GPT: a decoder-only transformer (byte-level by default), laid out as a sequence of pieces.

`style="gpt"` (the default) is GPT-2's block: learned positions, layer norms, a GELU MLP 4x wide,
biases. `style="llama"` is Llama's (Touvron et al. 2023): rotary positions on queries and keys,
RMS norms, a SwiGLU MLP `ffn` wide (default Llama's 2/3 x 4 x d_model rounded up to 256), no
biases; `gpt:layers=32,hidden=4096,heads=32,seq=4096,vocab=32000,style=llama,ffn=11008` is
Llama-2-7B's shape, 6,738,415,616 parameters.

`GPT` is an `nn.Sequential` of `[Embedding, Block, ..., Block, Head]`, so plain model parallelism
and pipeline stages are slices of it, and tensor parallelism rewrites the blocks in place.
The attention's fused `qkv` projection has output rows laid out as (3, n_heads, head_dim):
all query heads, then all key heads, then all value heads. No dropout: runs are deterministic.
`TP_PLAN` (also `GPT.tp_plan`) says how tensor parallelism splits it, `SEQUENCE_TP_PLAN` the same with
sequence parallelism (gpt style); their patterns start with `*` so they match the whole GPT and any
pipeline stage of it (an nn.Sequential of its pieces) alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

from paraloom.config.errors import UserError

# module-name pattern -> tensor-parallel style (tensor_parallel/module_plan.py; Shoeybi et al. 2019, figure 3)
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
# Llama: the MLP's gate and up projections are stacked in one weight: each rank keeps its rows of both
LLAMA_TP_PLAN: dict[str, Any] = {**TP_PLAN, "*.mlp.fc": {"style": "colwise", "fused": 2}}
# TP_PLAN with sequence parallelism (Korthikanti et al. 2022, figure 5): between the blocks' column and row
# layers every rank holds its share of the sequence, so the norms run on a share each and the all-reduces
# become all-gathers (into qkv, fc and out) and reduce-scatters (out of the embedding, proj and proj);
# the position embedding's (seq_len, d_model) output is cut to the rank's positions to meet the tokens'
SEQUENCE_TP_PLAN: dict[str, Any] = {
    "*.tok": {"style": "vocab", "output": "sequence"},
    "*.pos": {"style": "prepare", "output": "replicate", "desired_output": "sequence", "sequence_dim": 0},
    "*.ln*": "sequence",
    "*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads", "input": "sequence"},
    "*.attn.proj": {"style": "rowwise", "output": "sequence"},
    "*.mlp.fc": {"style": "colwise", "input": "sequence"},
    "*.mlp.proj": {"style": "rowwise", "output": "sequence"},
    "*.out": {"style": "colwise", "input": "sequence"},
}
STYLES = ("gpt", "llama")
ATTENTIONS = ("sdpa", "math")  # model.attention
RECOMPUTE = ("none", "selective", "full")  # model.recompute (true and false still read as full and none)


def recompute_mode(value: bool | str) -> str:
    """`model.recompute` as one of RECOMPUTE: true is full, false none."""
    mode = {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value
    if mode not in RECOMPUTE:
        raise UserError(f"the gpt's recompute={value!r} is not known; choose one of: {', '.join(RECOMPUTE)}")
    return mode


class Embedding(nn.Module):
    """Token embedding plus, unless `rotary`, a learned position embedding: (B, T) -> (B, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, *, rotary: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = None if rotary else nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        return x if self.pos is None else x + self.pos(torch.arange(idx.shape[1], device=idx.device))


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) of (B, heads, T, head_dim) queries or keys: each
    pair of features (i, i + head_dim / 2) turned by position x base^(-2i / head_dim)."""
    t, half = x.shape[-2], x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with its T x T scores and probabilities made in memory, as Megatron computed it
    before fused kernels (what selective recomputation was made for)."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v


class Attention(nn.Module):
    """Causal multi-head self-attention; `n_heads` is the number of heads this module computes.

    `attention="sdpa"` runs torch's fused kernel (which keeps no T x T scores), `"math"` spells it out
    (`math_attention`). With `selective`, the core (from q, k and v to the heads' outputs) is
    recomputed in backward instead of saved: Korthikanti et al. 2022's selective recomputation."""

    def __init__(self, d_model: int, n_heads: int, *, rotary: bool = False, bias: bool = True,
                 attention: str = "sdpa", selective: bool = False) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise UserError(f"the gpt's attention={attention!r} is not known; choose one of: "
                            f"{', '.join(ATTENTIONS)}")
        self.n_heads, self.head_dim, self.rotary = n_heads, d_model // n_heads, rotary
        self.attention, self.selective = attention, selective
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention == "math":
            return math_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism x holds a share of the sequence, qkv all of it
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary:
            q, k = rotate(q), rotate(k)
        if self.selective and self.training and torch.is_grad_enabled():
            # looked up on its module at the call, so the planner's profile can run it its way
            y = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """GELU MLP (`fc` to `width`, `proj` back), or SwiGLU (`fc` holds the gate and up projections)."""

    def __init__(self, d_model: int, width: int, *, gated: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.gated = gated
        self.fc = nn.Linear(d_model, 2 * width if gated else width, bias=bias)
        self.proj = nn.Linear(width, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block; with `recompute` ("full", or True) its activations are recomputed
    in backward, with "selective" its attention core alone."""

    def __init__(self, d_model: int, n_heads: int, *, recompute: bool | str = False, style: str = "gpt",
                 ffn: int | None = None, attention: str = "sdpa") -> None:
        super().__init__()
        llama = style == "llama"
        mode = recompute_mode(recompute)
        norm = (lambda: nn.RMSNorm(d_model, eps=1e-5)) if llama else (lambda: nn.LayerNorm(d_model))
        self.ln1 = norm()
        self.attn = Attention(d_model, n_heads, rotary=llama, bias=not llama, attention=attention,
                              selective=mode == "selective")
        self.ln2 = norm()
        self.mlp = FeedForward(d_model, ffn or 4 * d_model, gated=llama, bias=not llama)
        self.recompute = mode == "full"

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Head(nn.Module):
    """Final norm and the language-model head: (B, T, d_model) -> (B, T, vocab) logits."""

    def __init__(self, d_model: int, vocab_size: int, *, rms: bool = False) -> None:
        super().__init__()
        self.ln = nn.RMSNorm(d_model, eps=1e-5) if rms else nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def llama_ffn(d_model: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4 x d_model, rounded up to a multiple of `multiple_of`."""
    width = int(2 * 4 * d_model / 3)
    return multiple_of * -(-width // multiple_of)


class GPT(nn.Sequential):
    """`GPT((seq_len,), vocab_size, n_layers=, d_model=, n_heads=, recompute=, style=, ffn=, attention=)`:
    logits (B, T, vocab)."""

    tp_plan: ClassVar[dict[str, Any]] = TP_PLAN
    shard_units: ClassVar[tuple[str, ...]] = ("Block",)  # parallel.shard's units (data_parallel/)

    def __init__(self, input_shape: tuple[int, ...], n_classes: int = 256, *, n_layers: int = 4,
                 d_model: int = 128, n_heads: int = 4, recompute: bool | str = False, style: str = "gpt",
                 ffn: int = 0, attention: str = "sdpa", **_: object) -> None:
        if len(input_shape) != 1:
            raise UserError(f"the gpt needs token sequences shaped (seq_len,), got {input_shape}: "
                            "use data.name=text")
        if d_model % n_heads:
            options = [h for h in range(1, d_model + 1) if d_model % h == 0]
            raise UserError(f"model.n_heads={n_heads} does not divide model.d_model={d_model}; "
                            f"choose n_heads in {{{', '.join(map(str, options))}}}")
        if style not in STYLES:
            raise UserError(f"the gpt's style={style!r} is not known; choose one of: {', '.join(STYLES)}")
        llama = style == "llama"
        if llama and (d_model // n_heads) % 2:
            raise UserError(f"rotary positions need an even head size; d_model={d_model} / n_heads={n_heads} "
                            f"is {d_model // n_heads}")
        width = ffn or (llama_ffn(d_model) if llama else 4 * d_model)
        super().__init__(Embedding(n_classes, input_shape[0], d_model, rotary=llama),
                         *(Block(d_model, n_heads, recompute=recompute, style=style, ffn=width,
                                 attention=attention) for _ in range(n_layers)),
                         Head(d_model, n_classes, rms=llama))
        if llama:
            self.tp_plan = LLAMA_TP_PLAN
        self.seq_len, self.vocab_size, self.n_layers = input_shape[0], n_classes, n_layers
        self.d_model, self.n_heads, self.style, self.ffn = d_model, n_heads, style, width

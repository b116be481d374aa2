"""apply_tensor_parallel: split a paraloom GPT (or a pipeline stage of it) over a tensor-parallel group.

Composition (Shoeybi et al. 2019, figure 3), per block: attention qkv column-parallel by heads ->
local attention -> proj row-parallel (one all-reduce), MLP fc column-parallel -> GELU -> proj
row-parallel (one all-reduce); 2 all-reduces forward and 2 backward. The token embedding is
vocabulary-parallel; the head's output layer is column-parallel over the vocabulary and returns
vocabulary-parallel logits for `tp_loss`. Layer norms, biases after a reduce and the position
embedding stay replicated (their gradients come out equal on every rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from paraloom.models.gpt import Block, Embedding, Head
from paraloom.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_divides,
    tp_choices,
    vocab_parallel_cross_entropy,
)
from paraloom.tensor_parallel.mappings import group_rank, group_size

if TYPE_CHECKING:
    from paraloom.trace.timeline import Timeline

PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _check_sizes(pieces: list[nn.Module], tp: int) -> None:
    """Refuse, before touching anything, a tp that does not divide every split size."""
    sizes: list[tuple[str, int]] = []
    for m in pieces:
        if isinstance(m, Embedding):
            sizes.append(("vocab_size", m.tok.num_embeddings))
        elif isinstance(m, Block):
            if not isinstance(m.attn.qkv, nn.Linear):
                raise ValueError("this block is tensor-parallel already; apply_tensor_parallel once")
            sizes += [("n_heads", m.attn.n_heads), ("mlp hidden size", m.mlp.fc.out_features)]
        elif isinstance(m, Head):
            sizes.append(("vocab_size", m.out.out_features))
    choices = tp_choices(*(size for _, size in sizes))
    order = ("n_heads", "mlp hidden size", "vocab_size")  # the most telling size is named first
    for name, size in sorted(sizes, key=lambda s: order.index(s[0])):
        check_divides(tp, name, size, choices)


def _split_block(block: Block, group: dist.ProcessGroup | None, tp: int, rank: int) -> None:
    attn = block.attn
    local_heads = attn.n_heads // tp
    width = local_heads * attn.head_dim  # this rank's share of d_model
    d_model = attn.n_heads * attn.head_dim
    own = torch.arange(rank * width, (rank + 1) * width)
    # qkv rows are laid out (3, n_heads, head_dim): this rank's heads of q, of k and of v
    rows = torch.cat([part * d_model + own for part in range(3)])
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, rows=rows)
    attn.proj = RowParallelLinear.from_linear(attn.proj, group, cols=own)
    attn.n_heads = local_heads
    block.mlp.fc = ColumnParallelLinear.from_linear(block.mlp.fc, group)
    block.mlp.proj = RowParallelLinear.from_linear(block.mlp.proj, group)


def apply_tensor_parallel(module: nn.Module, tp_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Rewrite in place every GPT Embedding, Block and Head in `module` to hold this rank's shard.

    Works on the whole GPT and on any slice of it (a pipeline stage). Every rank of `tp_group`
    must start from the same full weights (build the model with the same seed). Returns `module`.
    """
    tp, rank = group_size(tp_group), group_rank(tp_group)
    pieces = [m for m in module.modules() if isinstance(m, (Embedding, Block, Head))]
    _check_sizes(pieces, tp)
    if tp == 1:
        return module
    for m in pieces:
        if isinstance(m, Embedding):
            m.tok = VocabParallelEmbedding.from_embedding(m.tok, tp_group)
        elif isinstance(m, Block):
            _split_block(m, tp_group, tp, rank)
        else:
            m.out = ColumnParallelLinear.from_linear(m.out, tp_group)
    return module


def trace_tensor_parallel(module: nn.Module, timeline: Timeline | None) -> int:
    """Make every tensor-parallel layer in `module` record its collectives on `timeline` (lane "tp"),
    forward and backward, while the timeline is active; None detaches. Returns how many layers."""
    layers = [m for m in module.modules() if isinstance(m, PARALLEL_LAYERS)]
    for layer in layers:
        layer.timeline = timeline
    return len(layers)


def tp_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None = None,
            timeline: Timeline | None = None) -> torch.Tensor:
    """Mean token cross-entropy of vocabulary-parallel logits (B, T, vocab / tp) against targets (B, T).

    Replaces `F.cross_entropy(logits.flatten(0, 1), targets.flatten())` on a tensor-parallel GPT;
    `timeline` records its collectives (lane "tp") while active.
    """
    return vocab_parallel_cross_entropy(logits, targets, group, timeline)


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _gather_shard(shard: torch.Tensor, index: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    shards = [torch.empty_like(shard) for _ in range(size)]
    indices = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    dist.all_gather(indices, index, group=group)
    shape = list(shard.shape)
    shape[dim] *= size
    full = shard.new_empty(shape)
    return full.index_copy_(dim, torch.cat(indices).to(shard.device), torch.cat(shards, dim=dim))


@torch.no_grad()
def full_state_dict(module: nn.Module, tp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The unsplit state dict of a tensor-parallel `module` (collective over `tp_group`, on every rank).

    Keys and shapes match those of the module before `apply_tensor_parallel`.
    """
    layers = {name: m for name, m in module.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    out = {}
    for key, value in module.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is None or leaf not in layer.sharded or group_size(tp_group) == 1:
            out[key] = value.detach().clone()
        else:
            out[key] = _gather_shard(value.detach(), layer.full_index, layer.sharded[leaf], tp_group)
    return out


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsplit state dict (as `full_state_dict` returns) into a tensor-parallel `module`."""
    layers = {name: m for name, m in module.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    local = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is not None and leaf in layer.sharded:
            value = value.index_select(layer.sharded[leaf], layer.full_index.to(value.device))
        local[key] = value
    module.load_state_dict(local)

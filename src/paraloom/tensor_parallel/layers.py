"""Megatron layers (Shoeybi et al. 2019): column/row-parallel linears, vocabulary-parallel embedding and loss.

Each layer holds one rank's shard and remembers where it sits in the unsplit tensor (`sharded`: parameter
name -> split dimension; `full_index`: the unsplit indices along it), so full tensors can be rebuilt.
`from_linear` / `from_embedding` copy the right slice of an unsplit module, so a tensor-parallel model
built from a seeded full model computes exactly what the full model computes.
Each layer's `timeline` (None; set by `trace_tensor_parallel`) is handed to the collectives it runs.
A ColumnParallelLinear that does not gather marks its output as sharded on the last dimension
(`SHARDED_MARK`; read by `plan.is_tp_sharded`), so vocabulary-sharded logits can be told apart.
With `sequence_parallel` (Korthikanti et al. 2022) a layer meets activations sharded along the sequence
dimension `sequence_dim` instead of replicated ones: a column-parallel layer all-gathers its input
(backward: reduce-scatter), a row-parallel layer and the embedding reduce-scatter their output where they
would all-reduce it (backward: all-gather).
"""

from __future__ import annotations

import math
from math import gcd
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.config.errors import UserError
from paraloom.tensor_parallel.mappings import (
    all_gather_to_region,
    all_reduce,
    copy_to_region,
    gather_from_region,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_from_region,
    scatter_to_region,
    timed,
)

if TYPE_CHECKING:
    from paraloom.trace.timeline import Timeline

Group = dist.ProcessGroup | None
SHARDED_MARK = "_paraloom_tp_sharded"  # attribute set on a column-parallel layer's sharded output


def tp_choices(*sizes: int) -> list[int]:
    """The tensor-parallel sizes that divide every one of `sizes`."""
    common = 0
    for size in sizes:
        common = gcd(common, size)
    return [d for d in range(1, common + 1) if common % d == 0]


def check_divides(tp: int, name: str, size: int, choices: list[int] | None = None, *,
                  where: str = "") -> None:
    """Raise UserError when `tp` ranks cannot split `size` evenly, naming the valid choices
    (and, given `where`, the module the size belongs to, as a prefix)."""
    if size % tp:
        options = choices if choices is not None else tp_choices(size)
        raise UserError(f"{where + ': ' if where else ''}tp={tp} does not divide {name}={size}; "
                        f"choose tp in {{{', '.join(map(str, options))}}}")


def check_plain_embedding(embedding: nn.Embedding, name: str = "the nn.Embedding") -> None:
    """Refuse an embedding a vocabulary split cannot reproduce (padding_idx, max_norm, sparse)."""
    if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
        raise UserError(f"a vocabulary-parallel embedding supports plain lookups only; "
                        f"build {name} without padding_idx, max_norm and sparse")


def _index(selection: slice | torch.Tensor | list[int] | None, full: int, group: Group,
           name: str) -> torch.Tensor:
    """The unsplit indices this rank holds: `selection`, or by default its contiguous share of `full`."""
    size = group_size(group)
    if selection is None:
        check_divides(size, name, full)
        share = full // size
        start = group_rank(group) * share
        return torch.arange(start, start + share)
    index = torch.arange(full)[selection] if isinstance(selection, slice) else torch.as_tensor(selection)
    index = index.to(torch.long).flatten()
    if index.numel() * size != full:
        raise ValueError(f"each of {size} ranks must hold {full / size:g} of the {full} {name}, "
                         f"this one selects {index.numel()}")
    return index


def _sequence_repr(layer: nn.Module) -> str:
    return f", sequence_parallel=True, sequence_dim={layer.sequence_dim}" if layer.sequence_parallel else ""


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A's output features (rows of `weight`) split over ranks: replicated input (or,
    with `sequence_parallel`, sharded along `sequence_dim` and all-gathered here), parallel output, or
    the full output with `gather_output` (in rank order)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group: Group = None,
                 gather_output: bool = False, rows: slice | torch.Tensor | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # unsplit sizes
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.timeline: Timeline | None = None  # records this layer's collectives while active
        self.full_index = _index(rows, out_features, group, "out_features")
        self.sharded = {"weight": 0, "bias": 0}
        n = self.full_index.numel()
        self.weight = nn.Parameter(torch.empty(n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features)  # the distribution of an unsplit nn.Linear
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group = None, *, rows: slice | torch.Tensor | None = None,
                    gather_output: bool = False, sequence_parallel: bool = False,
                    sequence_dim: int = 1) -> ColumnParallelLinear:
        """This rank's rows of `linear` (`rows`: unsplit output indices; default its contiguous share)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    gather_output=gather_output, rows=rows, sequence_parallel=sequence_parallel,
                    sequence_dim=sequence_dim, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            index = layer.full_index.to(linear.weight.device)
            layer.weight.copy_(linear.weight.index_select(0, index))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.index_select(0, index))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output with `gather_output`; else this rank's features, marked as sharded on the
        last dimension (a later op returns an unmarked tensor: hand logits on as this layer gives them)."""
        if self.sequence_parallel:
            x = all_gather_to_region(x, self.group, self.timeline, dim=self.sequence_dim)
        else:
            x = copy_to_region(x, self.group, self.timeline)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            return gather_from_region(y, self.group, self.timeline)
        setattr(y, SHARDED_MARK, True)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}{_sequence_repr(self)}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A's input features (columns of `weight`) split over ranks: parallel input
    (or replicated, scattered here), outputs all-reduced (or, with `sequence_parallel`, reduce-scattered
    along `sequence_dim`), the replicated bias added once after."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group: Group = None,
                 input_is_parallel: bool = True, cols: slice | torch.Tensor | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # unsplit sizes
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.timeline: Timeline | None = None  # records this layer's collectives while active
        self.full_index = _index(cols, in_features, group, "in_features")
        self.sharded = {"weight": 1}
        self.weight = nn.Parameter(torch.empty(out_features, self.full_index.numel(), device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group = None, *, cols: slice | torch.Tensor | None = None,
                    input_is_parallel: bool = True, sequence_parallel: bool = False,
                    sequence_dim: int = 1) -> RowParallelLinear:
        """This rank's columns of `linear` (`cols`: unsplit input indices; default its contiguous share)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    input_is_parallel=input_is_parallel, cols=cols, sequence_parallel=sequence_parallel,
                    sequence_dim=sequence_dim, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.index_select(1, layer.full_index.to(linear.weight.device)))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, self.timeline)
        y = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_region(y, self.group, self.timeline)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_from_region(y, self.group, self.timeline, dim=self.sequence_dim)
        # the bias meets this rank's share of the sequence only: its gradient is summed over the ranks
        return y if self.bias is None else y + copy_to_region(self.bias, self.group, self.timeline)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}{_sequence_repr(self)}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split in contiguous ranges over ranks: ids outside
    this rank's range look up zeros, and the all-reduce adds the one rank that owns each id (with
    `sequence_parallel`, a reduce-scatter leaving each rank its share of `sequence_dim`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.timeline: Timeline | None = None  # records this layer's collectives while active
        self.full_index = _index(None, num_embeddings, group, "vocab_size")
        self.vocab_start = int(self.full_index[0])
        self.vocab_end = self.vocab_start + self.full_index.numel()
        self.sharded = {"weight": 0}
        self.weight = nn.Parameter(torch.empty(self.full_index.numel(), embedding_dim, device=device,
                                               dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group = None, *, sequence_parallel: bool = False,
                       sequence_dim: int = 1) -> VocabParallelEmbedding:
        """This rank's vocabulary range of `embedding` (plain lookups only: no padding_idx or max_norm)."""
        check_plain_embedding(embedding)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                    device=embedding.weight.device, dtype=embedding.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.vocab_start: layer.vocab_end])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_from_region(out, self.group, self.timeline, dim=self.sequence_dim)
        return reduce_from_region(out, self.group, self.timeline)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"vocab range [{self.vocab_start}, {self.vocab_end}){_sequence_repr(self)}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split by vocabulary (Shoeybi et al. 2019, section 3).

    With label smoothing e (Szegedy et al. 2016) the target is (1 - e) one-hot + e / V, so the loss is
    log-sum-exp - (1 - e) logit_y - e mean(logits) and its gradient softmax - (1 - e) one-hot - e / V:
    the mean needs each rank's sum of its logits, added in the same all-reduce as the rest.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, timeline, smoothing=0.0):
        n_local = logits.shape[-1]
        start = group_rank(group) * n_local
        ctx.dtype, ctx.smoothing, ctx.vocab = logits.dtype, smoothing, n_local * group_size(group)
        logits = logits.float()
        top = timed(timeline, "all_reduce max cross_entropy forward", all_reduce, logits.max(dim=-1).values,
                    group, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        outside = (targets < start) | (targets >= start + n_local)
        local = (targets - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = [picked, exp.sum(dim=-1)] + ([shifted.sum(dim=-1)] if smoothing else [])
        sums = timed(timeline, "all_reduce sum cross_entropy forward", all_reduce, torch.stack(sums),
                     group)  # one collective
        picked, total = sums[0], sums[1]
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        if smoothing:
            return total.log() - (1.0 - smoothing) * picked - smoothing * sums[2] / ctx.vocab
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        out = softmax.clone()
        hit = (~outside).to(out.dtype).unsqueeze(-1) * (1.0 - ctx.smoothing)
        out.scatter_add_(-1, local.unsqueeze(-1), -hit)
        if ctx.smoothing:
            out.sub_(ctx.smoothing / ctx.vocab)
        return out.mul_(grad.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 group: Group = None, timeline: Timeline | None = None, *,
                                 smoothing: float = 0.0) -> torch.Tensor:
    """Mean token cross-entropy of vocabulary-parallel logits (..., vocab / tp) against targets (...);
    equal to F.cross_entropy over the full logits (`smoothing`: its label_smoothing). Rank r holds the
    r-th contiguous vocabulary range.
    `timeline` records its two forward all-reduces (backward runs none)."""
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(local_logits.shape)} and targets {tuple(targets.shape)} "
                         "differ before the vocabulary dimension")
    timeline = timeline if group_size(group) > 1 else None  # one rank: the all-reduces are copies
    losses = _VocabParallelCrossEntropy.apply(local_logits.flatten(0, -2), targets.flatten(), group, timeline,
                                              smoothing)
    return losses.mean().to(local_logits.dtype)


PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)

"""The DDP drop-in against torch's DDP on a transformer shaped like minGPT: the benchmark's worker.

Every rank builds one model per (wrapper, placement) pair from the same seed, so DDP and
`paraloom.DataParallel` train the same weights on the same data; the pairs then take turns, a
block of `steps` timed steps each, for `repeats` rounds, the order within a round alternating
(ABAB, BABA, ...) so that drift on a noisy machine weighs on both alike. The loop is the one a
DDP script runs (minGPT's trainer): forward returning (logits, loss), `zero_grad(set_to_none=True)`,
backward, clipping by the global norm, the optimizer's step, `loss.item()`.

Placements: eager; `torch.compile(wrapper(model))` ("compiled_outside"); `wrapper(torch.compile(
model))` ("compiled_inside"), inductor on CPU. Per (case, round) the figure is the slowest rank's
median step; the ratio drop-in / DDP is taken round by round, and its median over rounds is reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PLACEMENTS = ("eager", "compiled_outside", "compiled_inside")
WRAPPERS = ("ddp", "drop_in")


def gpt(*, vocab: int, seq: int, layers: int, width: int, heads: int, dropout: float, tied: bool):
    """A minGPT-shaped language model (torch's MultiheadAttention, a projection after it, pre-norm
    blocks, a learned position table, an untied or tied output layer) returning (logits, loss)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
            self.proj = nn.Linear(width, width)
            self.drop = nn.Dropout(dropout)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            y = self.attn(x, x, x, attn_mask=self.mask[:t, :t], need_weights=False)[0]
            return self.drop(self.proj(y))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                     nn.Dropout(dropout))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Parameter(torch.zeros(1, seq, width))
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            if tied:
                self.head.weight = self.tokens.weight

        def forward(self, idx: torch.Tensor, targets: torch.Tensor):
            x = self.drop(self.tokens(idx) + self.positions[:, :idx.shape[1]])
            logits = self.head(self.ln(self.blocks(x)))
            return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def _build(wrapper: str, placement: str, model_options: dict[str, Any], bucket_mb: float):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from paraloom import DataParallel

    torch.manual_seed(0)
    net = gpt(**model_options)
    inner = torch.compile(net) if placement == "compiled_inside" else net
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(inner, bucket_cap_mb=bucket_mb)
    else:
        wrapped = DataParallel(inner, bucket_cap_mb=bucket_mb)
    model = torch.compile(wrapped) if placement == "compiled_outside" else wrapped
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def _block(model, optimizer, batches: list, count: int, losses: list[float]) -> float:
    """`count` steps of the DDP loop on `batches` in turn; their median seconds. Appends each loss."""
    import torch

    times = []
    for i in range(count):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank: every case of `options["cases"]` ({name: {"placement", "dropout", "tied"}}), DDP
    and the drop-in taking turns; per case and round, each wrapper's median step (slowest rank)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shape = options["model"]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randint(0, shape["vocab"], (options["batch"], shape["seq"]), generator=gen),
                torch.randint(0, shape["vocab"], (options["batch"], shape["seq"]), generator=gen))
               for _ in range(4)]
    out: dict[str, Any] = {}
    for name, case in options["cases"].items():
        model_options = {**shape, "dropout": case["dropout"], "tied": case["tied"]}
        runs = {w: _build(w, case["placement"], model_options, options["bucket_mb"]) for w in WRAPPERS}
        losses: dict[str, list[float]] = {w: [] for w in WRAPPERS}
        for wrapper in WRAPPERS:  # warm-up (compilation, first buckets)
            _block(*runs[wrapper], batches, options["warmup"], [])
        rounds: dict[str, list[float]] = {w: [] for w in WRAPPERS}
        for r in range(options["repeats"]):
            for wrapper in (WRAPPERS if r % 2 == 0 else WRAPPERS[::-1]):
                step_s = _block(*runs[wrapper], batches, options["steps"], losses[wrapper])
                seconds = torch.tensor(step_s, dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                rounds[wrapper].append(float(seconds))
        ratios = [d / b for d, b in zip(rounds["drop_in"], rounds["ddp"], strict=True)]
        out[name] = {**case, "seconds": rounds, "ratio_per_round": ratios,
                     "ratio": statistics.median(ratios),
                     "ddp_step_s": statistics.median(rounds["ddp"]),
                     "drop_in_step_s": statistics.median(rounds["drop_in"]),
                     # without dropout both train the same arithmetic on the same batches: the same losses
                     "max_loss_gap": None if case["dropout"] else max(
                         abs(a - b) for a, b in zip(losses["ddp"], losses["drop_in"], strict=True))}
        if save is not None:
            save(out)
        del runs
    dist.destroy_process_group()
    return out

"""Mask-aware gradient sync: a bucket piece that pruning left sparse sends only its unmasked values.

Masks are identical on every rank (`MagnitudePruner` broadcasts them), so positions never travel:
every rank gathers the same alive positions of its gradient piece, the compact vectors are
all-reduced (the payload is summable), and the sum is scattered back with zeros at the pruned
positions. A piece whose density is at or above `threshold` goes dense, as without pruning.
Plugged into the data-parallel engine as its compressor: `MaskedSync(engine, threshold)` then
`set_masks(pruner.masks_by_parameter())` after every mask update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MaskedSync:
    """The engine's compressor while pruning: compact payloads for pieces below `threshold` density."""

    name = "masked"
    summable = True

    def __init__(self, engine, threshold: float = 0.5) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold={threshold} must lie in (0, 1]")
        self.engine, self.threshold = engine, threshold
        self.index: dict[int, torch.Tensor | None] = {}  # piece key -> alive positions, or None: dense
        engine.compressor = self

    def set_masks(self, masks: dict[nn.Parameter, torch.Tensor]) -> None:
        """Recompute every piece's alive positions from parameter -> bool mask (unmasked: all alive)."""
        for bucket in self.engine.buckets:
            alive = torch.ones(bucket.buffer.numel(), dtype=torch.bool, device=bucket.buffer.device)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                mask = masks.get(p)
                if mask is not None:
                    alive[offset: offset + p.numel()] = mask.reshape(-1)
            for piece in self.engine.pieces[bucket.index]:
                part = alive[piece.start: piece.stop]
                sparse = part.numel() and int(part.sum()) < self.threshold * part.numel()
                self.index[piece.key] = part.nonzero().flatten() if sparse else None

    def density(self) -> float:
        """Share of gradient elements that travel (pieces sent dense count whole)."""
        sizes = {piece.key: piece.stop - piece.start for pieces in self.engine.pieces for piece in pieces}
        sent = sum(n if self.index.get(k) is None else self.index[k].numel() for k, n in sizes.items())
        return sent / max(1, sum(sizes.values()))

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, Any]:
        positions = self.index.get(key)
        if positions is None:
            return tensor, None  # dense: all-reduced in place, as without pruning
        return tensor.index_select(0, positions), (positions, tensor.numel())

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return payload
        positions, n = ctx
        return payload.new_zeros(n).index_copy_(0, positions, payload)

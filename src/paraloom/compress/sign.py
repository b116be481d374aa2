"""Sign compressors with error feedback: 1-bit SGD (Seide et al. 2014) and EF-SignSGD (Karimireddy 2019)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from paraloom.compress.base import (
    ErrorFeedback,
    as_blocks,
    check_block,
    count_blocks,
    pack_bits,
    register,
    unpack_bits,
)


class _SignCompressor(ABC):
    """Shared shape: p = gradient + residual, cut into blocks of `block` consecutive elements
    (512 by default, as QSGD), each with its own scale(s); payload = fp32 scales as bytes + pack_bits(p >= 0).

    Per-block scales keep one large layer from setting the step size of every small one in a
    bucket that holds many layers. summable=False; with b = max(1, ceil(n / block)) blocks the
    payload is exactly 4 * k * b + ceil(n / 8) bytes for k scales per block and n elements (one
    bit per element plus 64 / block bits of scales: 1/30.1 of fp32 for efsign at the defaults); ctx is
    (shape, dtype). Error feedback (on by default) keeps p - decompress(payload) per key.
    """

    summable = False
    n_scales: int
    state_fields = ("memory",)

    def __init__(self, *, block: int = 512, error_feedback: bool = True) -> None:
        self.block = check_block(block)
        self.memory = ErrorFeedback() if error_feedback else None

    def payload_bytes(self, count: int) -> int:
        """Exact payload length in bytes for a tensor of `count` elements."""
        return 4 * self.n_scales * count_blocks(count, self.block) + -(-count // 8)

    @abstractmethod
    def _scales(self, rows: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The fp32 scales, (blocks, n_scales), of `rows` (blocks x block, zero-padded; `valid`
        marks the real elements)."""

    @abstractmethod
    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """The decoded (blocks x block) elements, from the scales and the signs."""

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, tuple]:
        ctx = (tensor.shape, tensor.dtype)
        corrected = self.memory.corrected(tensor, key) if self.memory is not None else tensor
        flat = corrected.reshape(-1).to(torch.float32)
        rows = as_blocks(flat, self.block)
        valid = as_blocks(torch.ones_like(flat, dtype=torch.bool), self.block)
        positive = rows >= 0
        scales = self._scales(rows, positive, valid).to(torch.float32).contiguous()
        payload = torch.cat([scales.view(-1).view(torch.uint8), pack_bits(positive.view(-1)[: flat.numel()])])
        if self.memory is not None:
            self.memory.remember(key, corrected, self.decompress(payload, ctx))
        return payload, ctx

    def decompress(self, payload: torch.Tensor, ctx: tuple) -> torch.Tensor:
        shape, dtype = ctx
        n = shape.numel()
        blocks = count_blocks(n, self.block)
        k = 4 * self.n_scales * blocks
        # clone: a gathered chunk may be unaligned
        scales = payload[:k].clone().view(torch.float32).view(blocks, self.n_scales)
        positive = as_blocks(unpack_bits(payload[k:], n), self.block)
        return self._values(scales, positive).view(-1)[:n].to(dtype).reshape(shape)


@register("onebit")
class OneBitCompressor(_SignCompressor):
    """1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs"): each element of p = gradient + residual
    becomes one bit (p >= 0), decoded to the mean of the elements on its side, as in the paper's
    two reconstruction values (here per block of `block` elements, not per matrix column):
    decompress(x) equals mean(p[p >= 0]) where p >= 0 and mean(p[p < 0]) elsewhere, per block
    (0 for an empty side). Two fp32 scales per block: 8b + ceil(n / 8) bytes. The error is kept
    and fed back (error_feedback=True).
    """

    n_scales = 2

    def _scales(self, rows: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        pos = (positive & valid).to(torch.float32)
        neg = (~positive & valid).to(torch.float32)
        count = torch.stack([pos.sum(dim=1), neg.sum(dim=1)], dim=1).clamp_(min=1.0)
        total = torch.stack([(rows * pos).sum(dim=1), (rows * neg).sum(dim=1)], dim=1)
        return total / count

    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return torch.where(positive, scales[:, :1], scales[:, 1:])


@register("efsign")
class EFSignCompressor(_SignCompressor):
    """Scaled sign with error feedback (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and
    other Gradient Compression Schemes", Algorithm 2 EF-SignSGD): with p = gradient + residual,
    send (||p||_1 / d) * sign(p), sign(0) = +1, per block of d elements (the paper's scale, taken
    per block). decompress(x) == scale * (+1 or -1) exactly. One fp32 scale per block:
    4b + ceil(n / 8) bytes.
    """

    n_scales = 1

    def _scales(self, rows: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        count = valid.sum(dim=1, keepdim=True).clamp_(min=1)
        return rows.abs().sum(dim=1, keepdim=True) / count  # padding is zero: adds nothing

    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return torch.where(positive, scales, -scales)

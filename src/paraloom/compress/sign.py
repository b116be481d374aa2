"""Sign compressors with error feedback: 1-bit SGD (Seide et al. 2014) and EF-SignSGD (Karimireddy 2019)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from paraloom.compress.base import ErrorFeedback, pack_bits, register, unpack_bits


class _SignCompressor(ABC):
    """Shared shape: p = gradient + residual; payload = fp32 scale(s) as bytes + pack_bits(p >= 0).

    summable=False; the payload is exactly 4 * k + ceil(n / 8) bytes for k scales and n elements;
    ctx is (shape, dtype). Error feedback (on by default) keeps p - decompress(payload) per key.
    """

    summable = False
    n_scales: int

    def __init__(self, *, error_feedback: bool = True) -> None:
        self.memory = ErrorFeedback() if error_feedback else None

    def payload_bytes(self, count: int) -> int:
        """Exact payload length in bytes for a tensor of `count` elements."""
        return 4 * self.n_scales + -(-count // 8)

    @abstractmethod
    def _scales(self, flat: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """The fp32 scale(s) sent with the signs of `flat`."""

    @abstractmethod
    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """The decoded elements, from the scale(s) and the signs."""

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, tuple]:
        ctx = (tensor.shape, tensor.dtype)
        corrected = self.memory.corrected(tensor, key) if self.memory is not None else tensor
        flat = corrected.reshape(-1).to(torch.float32)
        positive = flat >= 0
        scales = self._scales(flat, positive).to(torch.float32)
        payload = torch.cat([scales.view(torch.uint8), pack_bits(positive)])
        if self.memory is not None:
            self.memory.remember(key, corrected, self.decompress(payload, ctx))
        return payload, ctx

    def decompress(self, payload: torch.Tensor, ctx: tuple) -> torch.Tensor:
        shape, dtype = ctx
        k = 4 * self.n_scales
        scales = payload[:k].clone().view(torch.float32)  # clone: a gathered chunk may be unaligned
        positive = unpack_bits(payload[k:], shape.numel())
        return self._values(scales, positive).to(dtype).reshape(shape)


@register("onebit")
class OneBitCompressor(_SignCompressor):
    """1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs"): each element of p = gradient + residual
    becomes one bit (p >= 0), decoded to the mean of the elements on its side, as in the paper's
    two reconstruction values (here per bucket, not per matrix column): decompress(x) equals
    mean(p[p >= 0]) where p >= 0 and mean(p[p < 0]) elsewhere (0 for an empty side).
    Two fp32 scales: 8 + ceil(n / 8) bytes. The error is kept and fed back (error_feedback=True).
    """

    n_scales = 2

    def _scales(self, flat: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        pos = positive.to(torch.float32)
        count = torch.stack([pos.sum(), (1.0 - pos).sum()]).clamp_(min=1.0)
        total = torch.stack([(flat * pos).sum(), (flat * (1.0 - pos)).sum()])
        return total / count

    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return torch.where(positive, scales[0], scales[1])


@register("efsign")
class EFSignCompressor(_SignCompressor):
    """Scaled sign with error feedback (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and
    other Gradient Compression Schemes", Algorithm 2 EF-SignSGD): with p = gradient + residual,
    send (||p||_1 / n) * sign(p), sign(0) = +1. decompress(x) == scale * (+1 or -1) exactly.
    One fp32 scale: 4 + ceil(n / 8) bytes.
    """

    n_scales = 1

    def _scales(self, flat: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return (flat.abs().sum() / max(flat.numel(), 1)).reshape(1)

    def _values(self, scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        return torch.where(positive, scales[0], -scales[0])

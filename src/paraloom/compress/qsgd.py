"""QSGD: unbiased stochastic quantization to a few bits per element (Alistarh et al. 2017)."""

from __future__ import annotations

import hashlib

import torch

from paraloom.compress.base import ErrorFeedback, pack_nibbles, register, unpack_nibbles
from paraloom.errors import UserError


def _pack_crumbs(values: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 3] -> uint8, four per byte (element 4i + j in bits 2j, 2j+1 of byte i)."""
    flat = values.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    quads = flat.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack_crumbs(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `_pack_crumbs`: the first `count` values as uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 3).view(-1)[:count]


def _stream_seed(seed: int, key: int, step: int) -> int:
    """A 63-bit seed that depends on (seed, key, step) only: same inputs, same rounding."""
    digest = hashlib.blake2b(f"{seed}/{key}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@register("qsgd")
class QSGDCompressor:
    """QSGD (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization
    and Encoding"), without the Elias coding: fixed-width codes so every rank's payload has the
    same length.

    With s = 2**(bits-1) - 1 levels and the per-call (per-bucket) L2 norm ||x||, element x_i is
    sent as sign(x_i) * ||x|| * l_i / s, where l_i is |x_i| * s / ||x|| rounded down or up at
    random with the probabilities that make it unbiased: E[decompress(compress(x))] = x, and each
    element is off by less than ||x|| / s (up to fp32 rounding). The variance bound of the paper
    is E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) * ||x||^2.

    Payload (summable=False): one flat uint8 tensor, 4 bytes of the fp32 norm, then one code per
    element holding the sign (top bit) and the level (low bits - 1 bits): 8 bits -> 4 + n bytes,
    4 bits -> 4 + ceil(n / 2), 2 bits -> 4 + ceil(n / 4). The random rounding draws from a
    generator seeded by (seed, key, number of earlier calls for key): deterministic, different
    per bucket; pass a rank-dependent `seed` for independent rounding across ranks.
    With `error_feedback=True` the quantization error is added to the key's next gradient (only
    a contraction, so bounded, when sqrt(n) / s < 1: prefer 8 bits there).
    """

    summable = False

    def __init__(self, *, bits: int = 8, error_feedback: bool = False, seed: int = 0) -> None:
        if bits not in (2, 4, 8):
            raise UserError(f"qsgd bits={bits} is not supported; choose bits in {{2, 4, 8}}")
        self.bits = bits
        self.levels = 2 ** (bits - 1) - 1
        self.seed = seed
        self.memory = ErrorFeedback() if error_feedback else None
        self.steps: dict[int, int] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, key: int) -> torch.Generator:
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(_stream_seed(self.seed, key, step))

    def payload_bytes(self, count: int) -> int:
        """Exact payload length in bytes for a tensor of `count` elements."""
        return 4 + -(-count * self.bits // 8)

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, tuple]:
        ctx = (tensor.shape, tensor.dtype)
        corrected = self.memory.corrected(tensor, key) if self.memory is not None else tensor
        flat = corrected.reshape(-1).to(torch.float32)
        s = self.levels
        norm = torch.linalg.vector_norm(flat).reshape(1)  # 0 for an empty tensor
        inv = torch.where(norm > 0, s / norm, torch.zeros_like(norm))  # no host sync, no 0/0
        scaled = flat.abs() * inv
        low = scaled.floor()
        noise = torch.rand(flat.shape, generator=self._generator(flat.device, key), device=flat.device)
        levels = (low + (noise < scaled - low)).clamp_(max=s).to(torch.uint8)
        codes = levels | ((flat < 0).to(torch.uint8) << (self.bits - 1))
        if self.bits == 8:
            packed = codes
        elif self.bits == 4:
            packed = pack_nibbles(codes)
        else:
            packed = _pack_crumbs(codes)
        payload = torch.cat([norm.view(torch.uint8), packed])
        if self.memory is not None:
            self.memory.remember(key, corrected, self.decompress(payload, ctx))
        return payload, ctx

    def decompress(self, payload: torch.Tensor, ctx: tuple) -> torch.Tensor:
        shape, dtype = ctx
        count = shape.numel()
        norm = payload[:4].clone().view(torch.float32)  # clone: a gathered chunk may be unaligned
        if self.bits == 8:
            codes = payload[4:4 + count]
        elif self.bits == 4:
            codes = unpack_nibbles(payload[4:], count)
        else:
            codes = _unpack_crumbs(payload[4:], count)
        levels = (codes & self.levels).to(torch.float32)
        signs = 1.0 - 2.0 * (codes >> (self.bits - 1)).to(torch.float32)
        return (levels * signs * (norm / self.levels)).to(dtype).reshape(shape)

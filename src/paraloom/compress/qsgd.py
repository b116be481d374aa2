"""QSGD: unbiased stochastic quantization to a few bits per element (Alistarh et al. 2017)."""

from __future__ import annotations

import hashlib

import torch

from paraloom.compress.base import (
    ErrorFeedback,
    as_blocks,
    check_block,
    count_blocks,
    pack_nibbles,
    register,
    unpack_nibbles,
)
from paraloom.config.errors import UserError


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

    The tensor is cut into blocks of `block` consecutive elements (the paper's "bucket size" d,
    512 by default), each with its own L2 norm. With s = 2**(bits-1) - 1 levels and x_i in a block
    of norm ||x||, x_i is sent as sign(x_i) * ||x|| * l_i / s, where l_i is |x_i| * s / ||x||
    rounded down or up at random with the probabilities that make it unbiased:
    E[decompress(compress(x))] = x, and each element is off by less than its block's ||x|| / s
    (up to fp32 rounding). The variance bound of the paper, per block of d elements, is
    E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) * ||x||^2 — small blocks keep it small, where one
    norm over a whole model would let a few large gradients drown every small one in noise.

    Payload (summable=False): one flat uint8 tensor, the fp32 norms (4 bytes per block, at least
    one block), then one code per element holding the sign (top bit) and the level (low bits - 1
    bits): with b = max(1, ceil(n / block)), 8 bits -> 4b + n bytes, 4 bits -> 4b + ceil(n / 2),
    2 bits -> 4b + ceil(n / 4). The random rounding draws from a
    generator seeded by (seed, key, number of earlier calls for key): deterministic, different
    per bucket; pass a rank-dependent `seed` for independent rounding across ranks.
    With `error_feedback=True` the quantization error is added to the key's next gradient (only
    a contraction, so bounded, when sqrt(block) / s < 1: 8 bits with blocks up to 16k elements).
    """

    summable = False
    state_fields = ("memory", "steps")

    def __init__(self, *, bits: int = 8, block: int = 512, error_feedback: bool = False,
                 seed: int = 0) -> None:
        if bits not in (2, 4, 8):
            raise UserError(f"qsgd bits={bits} is not supported; choose bits in {{2, 4, 8}}")
        self.bits = bits
        self.block = check_block(block)
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
        return 4 * count_blocks(count, self.block) + -(-count * self.bits // 8)

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, tuple]:
        ctx = (tensor.shape, tensor.dtype)
        corrected = self.memory.corrected(tensor, key) if self.memory is not None else tensor
        flat = corrected.reshape(-1).to(torch.float32)
        s = self.levels
        rows = as_blocks(flat, self.block)
        norm = torch.linalg.vector_norm(rows, dim=1)  # one per block; 0 for an all-zero block
        inv = torch.where(norm > 0, s / norm, torch.zeros_like(norm))  # no host sync, no 0/0
        scaled = rows.abs() * inv[:, None]
        low = scaled.floor()
        noise = torch.rand(rows.shape, generator=self._generator(flat.device, key), device=flat.device)
        levels = (low + (noise < scaled - low)).clamp_(max=s).to(torch.uint8)
        codes = (levels | ((rows < 0).to(torch.uint8) << (self.bits - 1))).view(-1)[: flat.numel()]
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
        head = 4 * count_blocks(count, self.block)
        norm = payload[:head].clone().view(torch.float32)  # clone: a gathered chunk may be unaligned
        if self.bits == 8:
            codes = payload[head:head + count]
        elif self.bits == 4:
            codes = unpack_nibbles(payload[head:], count)
        else:
            codes = _unpack_crumbs(payload[head:], count)
        levels = (codes & self.levels).to(torch.float32)
        signed = torch.where(codes >> (self.bits - 1) == 1, -levels, levels)
        values = as_blocks(signed, self.block) * (norm / self.levels)[:, None]
        return values.view(-1)[:count].to(dtype).reshape(shape)

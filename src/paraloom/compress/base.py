"""The Compressor protocol, the registry, error-feedback memory and bit packing (DESIGN.md §3).

A compressor is a stateful object. `compress(tensor, key)` returns `(payload, ctx)`: the
payload is what goes on the wire (its bytes are what wire accounting counts), ctx is whatever
this rank needs to decode; a payload may be a buffer the compressor reuses for the same key, valid
until the next `compress` with that key (the engine waits for a piece's collective first).
`decompress(payload, ctx)` returns a tensor shaped like the input.
`summable` says how payloads travel: True — payloads of all ranks can be all-reduced (summed)
and the sum decompressed; False — payloads are all-gathered, each decompressed, and the
results summed. A non-summable payload is one flat uint8 tensor of a size that depends only on
the input's size, the compressor's settings and the step (DGC's warm-up), so every rank's
payload has the same length.
Error-feedback memory (`ErrorFeedback`) lives in the compressor, keyed by bucket.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from paraloom.config.errors import UserError
from paraloom.config.rules import check_name

COMPRESSORS: dict[str, type] = {}


class Compressor(Protocol):
    name: str
    summable: bool

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor: ...


def register(name: str):
    """Class decorator: make a compressor available as `make_compressor(name, **options)`."""

    def add(cls: type) -> type:
        if name in COMPRESSORS:
            raise ValueError(f"compressor {name!r} is registered twice")
        cls.name = name
        COMPRESSORS[name] = cls
        return cls

    return add


def make_compressor(name: str, **options: Any):
    """A fresh compressor registered as `name`; an unknown name lists the registered ones."""
    return COMPRESSORS[check_name("comm.compressor", name, sorted(COMPRESSORS))](**options)


class ErrorFeedback:
    """Per-key residual memory: what compression dropped is added back before the next compression."""

    def __init__(self) -> None:
        self.residual: dict[int, torch.Tensor] = {}

    def corrected(self, tensor: torch.Tensor, key: int) -> torch.Tensor:
        """tensor + the residual kept for `key` (a new tensor; the input is left alone)."""
        memory = self.residual.get(key)
        return tensor + memory if memory is not None else tensor.clone()

    def remember(self, key: int, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep what was meant minus what was sent, for the next step."""
        self.residual[key] = corrected - sent


def count_blocks(n: int, block: int) -> int:
    """Blocks of `block` elements covering n elements; at least one, so a payload is never empty."""
    return max(1, -(-n // block))


def as_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """A flat tensor as (count_blocks(n, block), block) rows, zero-padded at the end."""
    pad = count_blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def check_block(block: int) -> int:
    if int(block) != block or block < 1:
        raise UserError(f"compressor block={block!r} must be a positive number of elements")
    return int(block)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool or 0/1 tensor -> uint8, 8 elements per byte (element i is bit i % 8 of byte i // 8)."""
    flat = bits.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 15] -> uint8, two per byte (element 2i in the low half of byte i)."""
    flat = values.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: the first `count` values as uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:count]

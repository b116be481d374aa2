"""The parameter server's wire format: one message each way per step, each with a 4-slot int32 header.

A worker's request to a server is [flags, clock, version, token | body]: flags say whether it
carries a gradient (PUSH), asks for the parameters (PULL) or says goodbye (DONE); SNAP marks the
worker's last push before a checkpoint at its new clock (the server holds the read until every
worker's push of that clock is in and it has taken its snapshot); NONFINITE says the worker found
NaN or Inf in the gradient and sent no body (it skips encoding, so that neither the payload nor a
compressor's error-feedback memory carries them; the server drops the push). Clock is the
worker's clock after this push (the clock it reads at); version is the server version of the
parameters the gradient was computed on; token identifies the run. The body is the shard's
gradient in fp32, or a compressor's fixed-size payload as bytes. A server's reply is
[version, status, slowest clock, 0 | parameters in fp32].

Putting the header inside the same tensor as the data costs one copy of a shard per message on
each side, and saves the second round trip a separate header would cost: on gloo a point-to-
point message costs ~1 ms of latency here, a copy of a 2 MB shard ~0.3 ms.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
import torch.distributed as dist

from paraloom.compress import make_compressor
from paraloom.config.errors import UserError
from paraloom.config.rules import check_push_compressor

SLOTS = 4  # int32 header slots (16 bytes) at the front of every message
PUSH, PULL, DONE, SNAP, NONFINITE = 1, 2, 4, 8, 16  # request flags (bits)
OK, REFUSED = 0, 1  # reply status
REQUEST, REPLY = 21, 22  # c10d tags of a server's first slice; slice j's are these + 2 j


def request_tag(slot: int) -> int:
    """The c10d tag of requests for a server's slice `slot` (0, 1, ... within that server)."""
    return REQUEST + 2 * slot


def reply_tag(slot: int) -> int:
    return REPLY + 2 * slot


def run_token(run_id: str) -> int:
    """A 31-bit token for a run id; workers present it, servers compare it with their own."""
    return zlib.crc32(run_id.encode()) & 0x7FFFFFFF


def draw_token() -> int:
    """A 31-bit token drawn by rank 0 for this attempt, on every rank (collective): a restarted run
    draws anew, so servers refuse requests left over from an earlier attempt."""
    token = torch.tensor([int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF], dtype=torch.int64)
    dist.broadcast(token, src=0)
    return int(token)


class Message:
    """A buffer of SLOTS int32 header slots followed by a body of `numel` elements of `dtype`."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        header_elements = SLOTS * 4 // torch.empty(0, dtype=dtype).element_size()
        self.buffer = torch.zeros(header_elements + numel, dtype=dtype)
        self.header = self.buffer[:header_elements].view(torch.int32)
        self.body = self.buffer[header_elements:]

    def write_header(self, *values: int) -> None:
        self.header.copy_(torch.tensor([*values, *[0] * (SLOTS - len(values))], dtype=torch.int32))

    def read_header(self) -> list[int]:
        return self.header.tolist()


class PushCodec:
    """How one shard's gradient travels in a push: fp32 as it is, or a compressor's payload.

    The payload's size and its decoding context depend only on the shard's size and the
    compressor's settings (choices.FIXED_SIZE_COMPRESSORS), so the server learns both from a
    template compression of zeros by its own instance and can post receives of the right size.
    """

    def __init__(self, n: int, compressor: str | None = None, options: dict[str, Any] | None = None) -> None:
        self.n = n
        self.name = compressor
        if compressor is None:
            self.dtype, self.numel, self.ctx = torch.float32, n, None
            self.compressor = None
            return
        check_push_compressor(compressor)
        options = dict(options or {})
        if compressor == "dgc" and options.get("warmup_steps", 0):
            raise UserError("dgc with a sparsity warm-up changes its payload size each step; "
                            "parameter-server pushes need warmup_steps=0")
        self.compressor = make_compressor(compressor, **options)
        payload, self.ctx = make_compressor(compressor, **options).compress(torch.zeros(n), -1)
        self.payload_dtype, self.payload_numel = payload.dtype, payload.numel()
        self.dtype, self.numel = torch.uint8, payload.numel() * payload.element_size()

    def message(self) -> Message:
        return Message(self.numel, self.dtype)

    @property
    def wire_bytes(self) -> int:
        """Bytes of one push to this shard's server, header included."""
        return SLOTS * 4 + self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def encode(self, grad: torch.Tensor, key: int, out: Message) -> None:
        """Write `grad` (this shard's fp32 gradient) into `out`'s body, compressed if so configured."""
        if self.compressor is None:
            out.body.copy_(grad)
            return
        payload, _ = self.compressor.compress(grad, key)
        if payload.numel() != self.payload_numel or payload.dtype != self.payload_dtype:
            raise RuntimeError(f"{self.name} produced a payload of {payload.numel()} {payload.dtype} "
                               f"elements; the server expects {self.payload_numel} {self.payload_dtype}")
        out.body.copy_(payload.reshape(-1).view(torch.uint8))

    def decode(self, body: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient a received body stands for (a view of it when uncompressed)."""
        if self.compressor is None:
            return body
        payload = body.view(self.payload_dtype)
        return self.compressor.decompress(payload, self.ctx).reshape(-1)

"""Half-precision gradient exchange: cast to float16 or bfloat16 on the wire, sum there, cast back."""

from __future__ import annotations

import torch

from paraloom.compress.base import ErrorFeedback, register


class _CastCompressor:
    """Cast to `wire_dtype` for the wire; payloads are summable (the sum travels in `wire_dtype`).

    Mixed-precision communication as in Micikevicius et al. 2018, "Mixed Precision Training"
    (fp16) and Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training" (bf16).
    ctx is the input dtype; decompress casts back to it. With `error_feedback=True` the rounding
    error of each cast is kept per key and added to the next step's gradient.
    """

    wire_dtype: torch.dtype
    summable = True
    state_fields = ("memory",)

    def __init__(self, *, error_feedback: bool = False) -> None:
        self.memory = ErrorFeedback() if error_feedback else None
        self._wire: dict[int, torch.Tensor] = {}  # key -> its payload buffer, reused step after step

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.dtype]:
        """The payload of `key`: a buffer of its own, refilled each step (the engine waits for a
        piece's collective before that piece is compressed again), so no step allocates one."""
        if self.memory is None:
            wire = self._wire.get(key)
            if wire is None or wire.shape != tensor.shape or wire.device != tensor.device:
                wire = self._wire[key] = torch.empty_like(tensor, dtype=self.wire_dtype)
            return wire.copy_(tensor), tensor.dtype
        corrected = self.memory.corrected(tensor, key)
        payload = corrected.to(self.wire_dtype)
        self.memory.remember(key, corrected, payload.to(tensor.dtype))
        return payload, tensor.dtype

    def decompress(self, payload: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return payload.to(ctx)

    def decompress_into(self, payload: torch.Tensor, ctx: torch.dtype, out: torch.Tensor) -> None:
        """`out.copy_(decompress(payload, ctx))` in one pass: the copy casts."""
        out.copy_(payload.view_as(out))

    @property
    def carries_nonfinite(self) -> bool:
        """Whether any rank's NaN or Inf reaches the decoded sum and nothing else keeps it: casts
        keep them (and an fp16 overflow becomes one); an error-feedback memory would keep its own."""
        return self.memory is None


@register("fp16")
class FP16Compressor(_CastCompressor):
    """float16 on the wire (Micikevicius et al. 2018). Relative error <= 2**-11 per element for
    |x| in [6.1e-5, 65504]; smaller values lose relative precision (absolute error <= 3e-8), and
    |x| (or a sum of payloads) above 65504 overflows to inf: scale the loss or use bf16."""

    wire_dtype = torch.float16


@register("bf16")
class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire (Kalamkar et al. 2019): float32's range, relative error <= 2**-8."""

    wire_dtype = torch.bfloat16

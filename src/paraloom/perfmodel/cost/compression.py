"""Wire bytes of each gradient compressor's payload (paraloom/compress), the time to exchange them,
and the time to encode and decode them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraloom.config.errors import UserError
from paraloom.config.rules import check_name
from paraloom.perfmodel.cost.network import LinkLike, allgather_time, allreduce_time

if TYPE_CHECKING:
    from paraloom.perfmodel.hardware import Hardware


@dataclass(frozen=True)
class WireFormat:
    """How the model prices one compressor's payload (paraloom/compress), one entry per compressor."""

    size_options: dict[str, Any]  # options that change the payload's size, at the constructor's defaults
    summable: bool  # the class's `summable`: payloads are all-reduced (True) or all-gathered (False)
    nbytes: Callable[[int, dict[str, Any]], float]  # wire bytes for `count` fp32 elements


def _blocks(count: int, block: int) -> int:
    return max(1, -(-count // block))  # compress/base.py count_blocks: at least one block


def _kept(count: int, density: float) -> int:
    return 0 if count == 0 else min(count, max(1, math.ceil(density * count)))  # compress/topk.py count_kept


def _signs(scales: int) -> Callable[[int, dict[str, Any]], float]:
    return lambda n, o: 4.0 * scales * _blocks(n, o["block"]) + -(-n // 8)  # fp32 scales + sign bits


# With n fp32 elements and b = ceil(n / block) blocks (see `compressed_bytes`).
WIRE_FORMATS: dict[str, WireFormat] = {
    "none": WireFormat({}, True, lambda n, o: 4.0 * n),
    "fp16": WireFormat({}, True, lambda n, o: 2.0 * n),
    "bf16": WireFormat({}, True, lambda n, o: 2.0 * n),
    "qsgd": WireFormat({"bits": 8, "block": 512}, False,
                       lambda n, o: 4.0 * _blocks(n, o["block"]) + -(-n * o["bits"] // 8)),
    "onebit": WireFormat({"block": 512}, False, _signs(2)),
    "efsign": WireFormat({"block": 512}, False, _signs(1)),
    "topk": WireFormat({"density": 0.01}, False, lambda n, o: 8.0 * _kept(n, o["density"])),
    "randomk": WireFormat({"density": 0.1}, True, lambda n, o: 4.0 * _kept(n, o["density"])),
    "dgc": WireFormat({"density": 0.001}, False, lambda n, o: 8.0 * _kept(n, o["density"])),
    "powersgd": WireFormat({"rank": 2, "shapes": None}, True,
                           lambda n, o: 4.0 * sum(powersgd_rounds(n, o["rank"], o["shapes"]))),
}
# Constructor options that leave the size alone (accepted, so a compressor's options pass as they are).
# dgc's warmup_steps: the model is the steady state, after the warm-up's denser payloads.
_OTHER_OPTIONS = {"error_feedback", "seed", "momentum", "clip_norm", "sample_fraction", "warmup_steps",
                  "start_iter", "warm_start"}


def _options(compressor: str, given: dict[str, Any]) -> dict[str, Any]:
    defaults = WIRE_FORMATS[check_name("compressor", compressor, WIRE_FORMATS)].size_options
    unknown = set(given) - set(defaults) - _OTHER_OPTIONS
    if unknown:
        raise UserError(f"compressor {compressor} takes no option {', '.join(sorted(unknown))}; "
                        f"its size options are: {', '.join(defaults) or '(none)'}")
    out = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    if "density" in out and not 0 < out["density"] <= 1:
        raise UserError(f"compressor density={out['density']!r} must be in (0, 1]")
    if "bits" in out and out["bits"] not in (2, 4, 8):
        raise UserError(f"qsgd bits={out['bits']} is not supported; choose bits in {{2, 4, 8}}")
    if "block" in out and (int(out["block"]) != out["block"] or out["block"] < 1):
        raise UserError(f"compressor block={out['block']!r} must be a positive number of elements")
    if "rank" in out and out["rank"] < 1:
        raise UserError(f"powersgd rank={out['rank']!r} must be >= 1")
    return out


def powersgd_rounds(count: int, rank: int = 2,
                    shapes: Sequence[Sequence[int]] | None = None) -> tuple[float, float]:
    """Elements all-reduced in PowerSGD's two rounds over `count` fp32 gradient elements.

    Round one carries P = M Q (rows x r per matrix) and every tensor sent plainly; round two
    Q = M^T P^ (cols x r), r = min(rank, rows, cols) (Vogels, Karimireddy & Jaggi 2019, Alg. 1).
    A tensor is compressed when it has 2+ dimensions (viewed as shape[0] x the rest) and
    rank * (rows + cols) < rows * cols (compress/powersgd.py should_compress); elements not
    covered by `shapes` travel plainly. Without `shapes` the elements are taken as one square
    matrix, sqrt(count) on a side — an assumption; pass the bucket's parameter shapes for
    the exact count (a layer of biases or a narrow matrix sends more).
    """
    first = second = 0.0
    if shapes is None:
        side = math.sqrt(count)
        if rank * 2 * side < count:
            return side * rank, side * rank
        return float(count), 0.0
    listed = 0
    for shape in shapes:
        numel = math.prod(shape)
        listed += numel
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        if rows and rank * (rows + cols) < rows * cols:
            r = min(rank, rows, cols)
            first, second = first + rows * r, second + cols * r
        else:
            first += numel
    if listed > count:
        raise UserError(f"powersgd shapes hold {listed} elements but the gradient has {count}; "
                        "pass the shapes of this bucket's parameters only")
    return first + count - listed, second


def compressed_bytes(nbytes_fp32: float, compressor: str | None, **options: Any) -> float:
    """Bytes one rank puts on the wire for an fp32 gradient bucket of `nbytes_fp32` bytes.

    Exact for one compress() call (one bucket) of each compressor in paraloom/compress; for a
    model cut into several buckets each bucket's at-least-one-block rounding adds a few bytes.
    With n = nbytes_fp32 / 4 elements and b = ceil(n / block) blocks:
    fp16, bf16: 2n. qsgd: 4b fp32 norms + ceil(n * bits / 8) codes. onebit: 8b (two fp32
    means per block) + ceil(n / 8) sign bits; efsign: 4b + ceil(n / 8). topk, dgc: 8k (k fp32
    values + k int32 indices), k = max(1, ceil(density * n)); randomk: 4k (indices come from a
    shared seed). powersgd: 4 * (both rounds' elements, see powersgd_rounds). none: 4n.
    """
    name = compressor or "none"
    opts = _options(name, options)
    count = math.ceil(nbytes_fp32 / 4)
    if name == "none":
        return float(nbytes_fp32)
    return WIRE_FORMATS[name].nbytes(count, opts)


def summable(compressor: str | None) -> bool:
    """True when payloads are all-reduced (summed on the wire), False when they are all-gathered."""
    name = compressor or "none"
    _options(name, {})
    return WIRE_FORMATS[name].summable


def compressed_sync_time(nbytes_fp32: float, n: int, link: LinkLike, compressor: str | None,
                         algorithm: str = "ring", **options: Any) -> float:
    """Seconds to average an fp32 bucket of `nbytes_fp32` over n ranks through `compressor`.

    As data_parallel/compressed.py does it: a summable payload is all-reduced with `algorithm`;
    any other is all-gathered by a ring, n payloads of P bytes (n - 1 of them arrive at every
    rank: (n-1) P / B, which grows with n where an all-reduce does not). PowerSGD runs two
    all-reduces, one after the other (data_parallel/lowrank.py), so it pays two rounds of latency.
    Encoding and decoding time is not included: it is computation.
    """
    name = compressor or "none"
    opts = _options(name, options)
    if name == "powersgd":
        first, second = powersgd_rounds(math.ceil(nbytes_fp32 / 4), opts["rank"], opts["shapes"])
        rounds = allreduce_time(4 * first, n, link, algorithm)
        return rounds + (allreduce_time(4 * second, n, link, algorithm) if second else 0.0)
    payload = compressed_bytes(nbytes_fp32, name, **options)
    if WIRE_FORMATS[name].summable:
        return allreduce_time(payload, n, link, algorithm)
    return allgather_time(n * payload, n, link)


def codec_time(hw: Hardware, compressor: str, grad_bytes: float) -> float:
    """Encode plus decode seconds per step: measured seconds per byte (`codec_s_per_byte.<name>`,
    from `paraloom calibrate`) or else `codec_passes.<name>` passes over the gradient at memory
    bandwidth; the default pass counts are assumptions (fp16: read fp32, write fp16, and back: ~2;
    the quantizers ~4; top-k selection ~8)."""
    if compressor == "none":
        return 0.0
    measured = hw.constants.get(f"codec_s_per_byte.{compressor}")
    if measured:
        return measured * grad_bytes
    defaults = {"fp16": 2.0, "bf16": 2.0, "qsgd": 4.0, "onebit": 4.0, "efsign": 4.0, "topk": 8.0,
                "randomk": 4.0, "dgc": 8.0, "powersgd": 6.0}
    passes = hw.constants.get(f"codec_passes.{compressor}", defaults.get(compressor, 4.0))
    return passes * grad_bytes / hw.device.mem_bandwidth

"""Wire bytes of each gradient compressor's payload (paraloom/compress), and the time to exchange them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from paraloom.config import COMPRESSOR_NAMES
from paraloom.errors import UserError
from paraloom.perfmodel.network import LinkLike, allgather_time, allreduce_time

# Options that change the payload's size, with each compressor's defaults (its constructor's).
_SIZE_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "qsgd": {"bits": 8, "block": 512},
    "onebit": {"block": 512},
    "efsign": {"block": 512},
    "topk": {"density": 0.01},
    "randomk": {"density": 0.1},
    "dgc": {"density": 0.001},
    "powersgd": {"rank": 2, "shapes": None},
}
# Constructor options that leave the size alone (accepted, so a compressor's options pass as they are).
# dgc's warmup_steps: the model is the steady state, after the warm-up's denser payloads.
_OTHER_OPTIONS = {"error_feedback", "seed", "momentum", "clip_norm", "sample_fraction", "warmup_steps",
                  "start_iter", "warm_start"}
_SUMMABLE = {"none", "fp16", "bf16", "randomk", "powersgd"}  # each class's `summable` attribute
assert set(_SIZE_OPTIONS) == {"none", *COMPRESSOR_NAMES}, "every config.COMPRESSOR_NAMES has a size rule"


def _options(compressor: str, given: dict[str, Any]) -> dict[str, Any]:
    if compressor not in _SIZE_OPTIONS:
        raise UserError(f"compressor={compressor!r} is not known; choose one of: {', '.join(_SIZE_OPTIONS)}")
    defaults = _SIZE_OPTIONS[compressor]
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


def _blocks(count: int, block: int) -> int:
    return max(1, -(-count // block))  # compress/base.py count_blocks: at least one block


def _kept(count: int, density: float) -> int:
    return 0 if count == 0 else min(count, max(1, math.ceil(density * count)))  # compress/topk.py count_kept


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
    if name in ("fp16", "bf16"):
        return 2.0 * count
    if name == "qsgd":
        return 4.0 * _blocks(count, opts["block"]) + -(-count * opts["bits"] // 8)
    if name in ("onebit", "efsign"):
        scales = 2 if name == "onebit" else 1
        return 4.0 * scales * _blocks(count, opts["block"]) + -(-count // 8)
    if name in ("topk", "dgc"):
        return 8.0 * _kept(count, opts["density"])
    if name == "randomk":
        return 4.0 * _kept(count, opts["density"])
    first, second = powersgd_rounds(count, opts["rank"], opts["shapes"])
    return 4.0 * (first + second)


def summable(compressor: str | None) -> bool:
    """True when payloads are all-reduced (summed on the wire), False when they are all-gathered."""
    name = compressor or "none"
    _options(name, {})
    return name in _SUMMABLE


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
    if name in _SUMMABLE:
        return allreduce_time(payload, n, link, algorithm)
    return allgather_time(n * payload, n, link)

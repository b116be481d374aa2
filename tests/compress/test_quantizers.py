"""fp16/bf16, QSGD, 1-bit and EF-sign compressors: error bounds, exact sizes, error feedback, all-gather."""

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom.compress.base import make_compressor
from paraloom.compress.fp16 import BF16Compressor, FP16Compressor
from paraloom.compress.qsgd import QSGDCompressor
from paraloom.compress.sign import EFSignCompressor, OneBitCompressor

SIZES = [0, 1, 7, 8, 9, 1000, 1001]
SIZES = [0, 1, 7, 8, 9, 511, 512, 513, 1000, 1001]


def _blocks(n, block=512):  # one scale (or norm) per block of 512, at least one
    return max(1, math.ceil(n / block))


NON_SUMMABLE = {  # name, options -> exact payload bytes for n elements
    ("qsgd", 8): lambda n: 4 * _blocks(n) + n,
    ("qsgd", 4): lambda n: 4 * _blocks(n) + math.ceil(n / 2),
    ("qsgd", 2): lambda n: 4 * _blocks(n) + math.ceil(n / 4),
    ("onebit", None): lambda n: 8 * _blocks(n) + math.ceil(n / 8),
    ("efsign", None): lambda n: 4 * _blocks(n) + math.ceil(n / 8),
}


def _make(name, bits=None, **options):
    return make_compressor(name, bits=bits, **options) if bits else make_compressor(name, **options)


def _randn(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_registered_under_their_names():
    expected = {"fp16": FP16Compressor, "bf16": BF16Compressor, "qsgd": QSGDCompressor,
                "onebit": OneBitCompressor, "efsign": EFSignCompressor}
    for name, cls in expected.items():
        c = make_compressor(name)
        assert type(c) is cls and c.name == name
        assert c.summable == (name in ("fp16", "bf16"))


# ---- fp16 / bf16 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, wire, rtol", [("fp16", torch.float16, 1e-3), ("bf16", torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cast_round_trip_within_relative_bound(name, wire, rtol, dtype):
    c = make_compressor(name)
    x = _randn(1000, dtype=dtype).view(10, 100) * 10
    payload, ctx = c.compress(x, key=0)
    assert payload.dtype == wire and payload.shape == x.shape
    y = c.decompress(payload, ctx)
    assert y.dtype == dtype and y.shape == x.shape
    # fp16 subnormals (|x| < 6.1e-5) keep an absolute error <= 3e-8 instead of a relative one
    torch.testing.assert_close(y, x, rtol=rtol, atol=6e-8 if name == "fp16" else 0.0)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_payloads_sum_in_the_wire_dtype(name):
    c = make_compressor(name)
    xs = [_randn(100, seed=s) for s in range(3)]
    payloads = [c.compress(x, key=k) for k, x in enumerate(xs)]  # valid until its key compresses again
    total = c.decompress(sum(p for p, _ in payloads), payloads[0][1])
    torch.testing.assert_close(total, sum(xs), rtol=3e-2, atol=1e-2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_payload_is_two_bytes_per_element(name, n):
    payload, ctx = make_compressor(name).compress(_randn(n), key=0)
    assert payload.numel() * payload.element_size() == 2 * n
    assert make_compressor(name).decompress(payload, ctx).shape == (n,)


# ---- exact payload sizes ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name, bits", list(NON_SUMMABLE))
def test_packed_sizes_are_exact(name, bits, n):
    c = _make(name, bits)
    payload, ctx = c.compress(_randn(n), key=0)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == NON_SUMMABLE[(name, bits)](n) == c.payload_bytes(n)
    y = c.decompress(payload, ctx)
    assert y.shape == (n,) and y.dtype == torch.float32 and torch.isfinite(y).all()


@pytest.mark.parametrize("name, bits", list(NON_SUMMABLE))
def test_zero_and_shaped_tensors(name, bits):
    c = _make(name, bits)
    zero = torch.zeros(3, 5, dtype=torch.float64)
    y = c.decompress(*c.compress(zero, key=0))
    assert y.shape == (3, 5) and y.dtype == torch.float64 and torch.equal(y, zero)


# ---- QSGD ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_error_per_element_is_below_norm_over_s(bits):
    c = QSGDCompressor(bits=bits)
    s = 2 ** (bits - 1) - 1
    for seed in range(20):
        x = _randn(257, seed=seed) * (seed + 1)
        y = c.decompress(*c.compress(x, key=seed))
        assert ((y - x).abs() <= x.norm() / s * (1 + 1e-5)).all()
        assert (torch.sign(y) * torch.sign(x) >= 0).all()  # never the wrong sign


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_is_unbiased(bits):
    """The mean of 2000 seeded compressions is within 5 standard errors of x, per element.

    Each element is a two-point variable at most norm / s wide, so its deviation <= norm / (2 s).
    """
    draws, s = 2000, 2 ** (bits - 1) - 1
    x = _randn(64, seed=7)
    x[0] = 0.0
    c = QSGDCompressor(bits=bits, seed=3)
    mean = torch.stack([c.decompress(*c.compress(x, key=5)) for _ in range(draws)]).mean(dim=0)
    standard_error = x.norm() / (2 * s) / math.sqrt(draws)
    assert ((mean - x).abs() <= 5 * standard_error).all()
    assert mean[0] == 0.0


def test_qsgd_is_deterministic_in_seed_key_and_step():
    x = _randn(500)
    a, b = QSGDCompressor(bits=4, seed=1), QSGDCompressor(bits=4, seed=1)
    first = [a.compress(x, key=k)[0] for k in (0, 1, 0)]
    second = [b.compress(x, key=k)[0] for k in (0, 0, 1)]  # other call order across keys
    assert torch.equal(first[0], second[0])  # key 0, step 0
    assert torch.equal(first[2], second[1])  # key 0, step 1
    assert torch.equal(first[1], second[2])  # key 1, step 0
    assert not torch.equal(first[0], first[1])  # keys differ
    assert not torch.equal(first[0], first[2])  # steps differ
    assert not torch.equal(QSGDCompressor(bits=4, seed=2).compress(x, key=0)[0], first[0])  # seeds differ


def test_qsgd_rejects_unsupported_bits():
    with pytest.raises(ValueError, match=r"qsgd bits=3 is not supported; choose bits in \{2, 4, 8\}"):
        QSGDCompressor(bits=3)


# ---- 1-bit and scaled sign -----------------------------------------------------------------------

def test_efsign_is_scale_times_sign_exactly_per_block():
    c = EFSignCompressor(block=512, error_feedback=False)
    x = _randn(1001)
    x[3] = 0.0
    x[600:] *= 100  # the second block's scale must not leak into the first
    payload, ctx = c.compress(x, key=0)
    scales = payload[:8].clone().view(torch.float32)
    torch.testing.assert_close(scales, torch.stack([x[:512].abs().mean(), x[512:].abs().mean()]))
    sign = torch.where(x >= 0, 1.0, -1.0)
    expected = torch.cat([scales[0] * sign[:512], scales[1] * sign[512:]])
    assert torch.equal(c.decompress(payload, ctx), expected)


def test_onebit_sends_the_mean_of_each_side_per_block():
    c = OneBitCompressor(block=512, error_feedback=False)
    x = _randn(1001)
    x[512:] += 1.0  # the last block is mostly positive and shorter than a block
    payload, ctx = c.compress(x, key=0)
    means = payload[:16].clone().view(torch.float32).view(2, 2)
    for row, part in zip(means.tolist(), (x[:512], x[512:]), strict=True):
        torch.testing.assert_close(row[0], part[part >= 0].mean().item())
        torch.testing.assert_close(row[1], part[part < 0].mean().item())
    expected = torch.cat([torch.where(part >= 0, row[0], row[1])
                          for row, part in zip(means, (x[:512], x[512:]), strict=True)])
    assert torch.equal(c.decompress(payload, ctx), expected)
    ones = torch.full((5,), 2.0)  # one empty side decodes to 0 and does not divide by zero
    assert torch.equal(c.decompress(*c.compress(ones, key=1)), ones)


def test_qsgd_error_is_below_each_blocks_norm_over_s():
    c = QSGDCompressor(bits=4, block=100)
    x = _randn(1000)
    x[:100] *= 1000  # a loud first block must not set the precision of the others
    y = c.decompress(*c.compress(x, key=0))
    norms = x.view(10, 100).norm(dim=1, keepdim=True) / 7
    assert ((y - x).view(10, 100).abs() <= norms * (1 + 1e-5)).all()


@pytest.mark.parametrize("cls", [OneBitCompressor, EFSignCompressor, QSGDCompressor])
def test_block_must_be_positive(cls):
    with pytest.raises(ValueError, match="block=0 must be a positive number of elements"):
        cls(block=0)


@pytest.mark.parametrize("cls", [OneBitCompressor, EFSignCompressor])
def test_sign_compressors_feed_back_by_default(cls):
    c = cls()
    x = _randn(100)
    sent = c.decompress(*c.compress(x, key=4))
    torch.testing.assert_close(c.memory.residual[4], x - sent)
    assert cls(error_feedback=False).memory is None


# ---- error feedback over many steps --------------------------------------------------------------

EF_CASES = [  # name, options, residual bound as a multiple of max_t ||g_t||
    ("efsign", {}, 2.0),
    ("onebit", {}, 2.0),
    ("qsgd", {"bits": 8, "error_feedback": True}, 0.5),
    ("fp16", {"error_feedback": True}, 1e-3),
    ("bf16", {"error_feedback": True}, 1e-2),
]


@pytest.mark.parametrize("n", [37, 256])
@pytest.mark.parametrize("name, options, bound", EF_CASES)
def test_error_feedback_tracks_the_sum_of_gradients(name, options, bound, n):
    """sum_t sent_t = sum_t g_t - residual_T, and the residual stays bounded: it does not grow."""
    c = make_compressor(name, **options)
    gen = torch.Generator().manual_seed(n)
    sum_g, sum_sent, biggest, residuals = torch.zeros(n), torch.zeros(n), 0.0, []
    for _ in range(200):
        g = torch.randn(n, generator=gen, dtype=torch.float64).float()
        biggest = max(biggest, g.norm().item())
        sum_g += g
        sum_sent += c.decompress(*c.compress(g, key=9))
        residuals.append((sum_g - sum_sent).norm().item())
        torch.testing.assert_close(sum_g - sum_sent, c.memory.residual[9], rtol=0, atol=1e-3 * biggest)
    assert max(residuals) <= bound * biggest
    assert max(residuals[100:]) <= 1.5 * max(residuals[:100])  # no growth with t
    assert sum_g.norm() > 5 * max(residuals)  # the test is not vacuous: the sum is far bigger


# ---- all-gather across ranks ---------------------------------------------------------------------

GATHER_CASES = [("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 8}), ("qsgd", {"bits": 4}),
                ("qsgd", {"bits": 2}), ("onebit", {}), ("efsign", {})]
BUCKETS = [0, 1, 9, 1001]


def _exchange(rank, world):
    """Per compressor and bucket: sum over ranks via all-reduce (summable) or all-gather; own results."""
    out = {}
    for index, (name, options) in enumerate(GATHER_CASES):
        extra = {"seed": rank} if name == "qsgd" else {}  # independent rounding per rank
        c = make_compressor(name, **extra, **options)
        for key, n in enumerate(BUCKETS):
            x = _randn(n, seed=1000 * rank + 10 * index + key)
            payload, ctx = c.compress(x, key)
            own = c.decompress(payload, ctx)
            if c.summable:
                total = payload.clone()
                dist.all_reduce(total)
                summed = c.decompress(total, ctx)
            else:
                gathered = payload.new_empty(world * payload.numel())
                dist.all_gather_into_tensor(gathered, payload)
                summed = torch.zeros(n)
                for chunk in gathered.chunk(world):  # a non-summable payload is never empty
                    summed = summed + c.decompress(chunk, ctx)
            out[(name, options.get("bits"), n)] = (own, summed)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gathered_payloads_decompress_to_the_sum_of_each_ranks_own(world):
    results = run_workers(_exchange, world)
    for case, (own, _) in results[0].items():
        expected = torch.zeros_like(own)
        for r in range(world):
            expected = expected + results[r][case][0]
        for r in range(world):
            summed = results[r][case][1]
            if case[0] in ("fp16", "bf16"):  # the sum itself travels rounded to the wire dtype
                torch.testing.assert_close(summed, expected, rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(summed, expected), case


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_payloads_reuse_one_buffer_per_key_and_decode_in_place(name):
    c = make_compressor(name)
    first, ctx = c.compress(_randn(100, seed=0), key=3)
    x = _randn(100, seed=1)
    again, _ = c.compress(x, key=3)
    assert again.data_ptr() == first.data_ptr()  # no allocation per step
    assert c.compress(x, key=4)[0].data_ptr() != first.data_ptr()
    out = torch.empty(100)
    c.decompress_into(again, ctx, out)
    torch.testing.assert_close(out, c.decompress(again, ctx))

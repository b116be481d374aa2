"""The parameter server's wire format: headers inside the data tensor, push codecs, all-worker throughput."""

import pytest
import torch

from paraloom.compress import make_compressor
from paraloom.config.choices import FIXED_SIZE_COMPRESSORS
from paraloom.config.errors import UserError
from paraloom.parameter_server.message import (
    DONE,
    NONFINITE,
    PULL,
    PUSH,
    SLOTS,
    SNAP,
    Message,
    PushCodec,
    run_token,
)
from paraloom.parameter_server.throughput import all_workers_throughput


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_header_values_survive_in_a_float_or_byte_buffer(dtype):
    message = Message(10, dtype)
    message.write_header(3, 2**31 - 1, -1, 123456789)
    assert message.read_header() == [3, 2**31 - 1, -1, 123456789]
    assert message.body.numel() == 10 and message.header.numel() == SLOTS
    message.write_header(1, 2)
    assert message.read_header() == [1, 2, 0, 0]
    assert message.buffer.numel() * message.buffer.element_size() == 16 + 10 * message.body.element_size()


def test_request_flags_are_distinct_bits():
    flags = [PUSH, PULL, DONE, SNAP, NONFINITE]
    assert SNAP == 8 and all(f & (f - 1) == 0 for f in flags) and len(set(flags)) == len(flags)
    message = Message(1, torch.float32)
    message.write_header(SNAP | PUSH | PULL, 7)
    assert message.read_header()[0] & SNAP and not message.read_header()[0] & NONFINITE


def test_uncompressed_pushes_carry_the_gradient_as_it_is():
    codec = PushCodec(7)
    message = codec.message()
    grad = torch.randn(7)
    codec.encode(grad, 0, message)
    assert torch.equal(codec.decode(message.body), grad)
    assert codec.wire_bytes == 16 + 28


@pytest.mark.parametrize("name,options", [("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 4}), ("onebit", {}),
                                          ("efsign", {}), ("topk", {"density": 0.1}),
                                          ("dgc", {"density": 0.1, "momentum": 0.0})])
def test_compressed_pushes_decode_as_the_compressor_does(name, options):
    n = 1001
    worker, server = PushCodec(n, name, options), PushCodec(n, name, options)
    reference = make_compressor(name, **options)
    message = worker.message()
    torch.manual_seed(0)
    for step in range(3):  # error feedback: the same sequence of payloads as the compressor's own
        grad = torch.randn(n)
        torch.manual_seed(step)
        worker.encode(grad, 0, message)
        torch.manual_seed(step)
        payload, ctx = reference.compress(grad, 0)
        expected = reference.decompress(payload, ctx).reshape(-1)
        torch.testing.assert_close(server.decode(message.body), expected)
        assert message.body.numel() == payload.numel() * payload.element_size()
    assert worker.wire_bytes < PushCodec(n).wire_bytes


def test_pushes_refuse_compressors_whose_payload_changes():
    assert "randomk" not in FIXED_SIZE_COMPRESSORS and "powersgd" not in FIXED_SIZE_COMPRESSORS
    for name in ("randomk", "powersgd"):
        with pytest.raises(UserError, match="cannot compress parameter-server pushes"):
            PushCodec(100, name)
    with pytest.raises(UserError, match="warmup_steps=0"):
        PushCodec(100, "dgc", {"warmup_steps": 10})


def test_run_tokens_are_stable_and_differ_between_runs():
    assert run_token("a/0/run") == run_token("a/0/run")
    assert run_token("a/0/run") != run_token("a/1/run")
    assert 0 <= run_token("x") < 2**31


def test_all_workers_throughput_counts_the_window_where_everyone_trains():
    # worker 0: starts at 0, 10 samples per second until t=10; worker 1: starts at 2, 5 per second until 20
    fast = torch.tensor([[0.0, 0.0]] + [[float(t), 10.0] for t in range(1, 11)], dtype=torch.float64)
    slow = torch.tensor([[2.0, 0.0]] + [[float(t), 5.0] for t in range(3, 21)], dtype=torch.float64)
    # window (2, 10]: worker 0 has 8 steps of 10, worker 1 has 8 steps of 5 -> 120 samples in 8 s
    assert all_workers_throughput([fast, slow]) == pytest.approx(15.0)
    assert all_workers_throughput([fast]) == pytest.approx(10.0)
    assert all_workers_throughput([fast, torch.tensor([[11.0, 0.0]], dtype=torch.float64)]) == 0.0

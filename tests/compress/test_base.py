"""Registry, error-feedback memory and bit packing: exact sizes, exact round trips."""

import pytest
import torch

from paraloom.compress.base import (
    ErrorFeedback,
    make_compressor,
    pack_bits,
    pack_nibbles,
    unpack_bits,
    unpack_nibbles,
)
from paraloom.config.errors import UserError


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1000])
def test_bits_pack_eight_per_byte_and_round_trip(count):
    bits = torch.rand(count, generator=torch.Generator().manual_seed(count)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count // 8)
    assert torch.equal(unpack_bits(packed, count), bits)


def test_bit_order_is_little_endian_within_a_byte():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1])).tolist() == [129]


@pytest.mark.parametrize("count", [0, 1, 2, 3, 1001])
def test_nibbles_pack_two_per_byte_and_round_trip(count):
    values = torch.randint(0, 16, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_nibbles(values)
    assert packed.numel() == -(-count // 2)
    assert torch.equal(unpack_nibbles(packed, count), values.to(torch.uint8))


def test_error_feedback_keeps_what_was_not_sent_per_key():
    memory = ErrorFeedback()
    g = torch.tensor([1.0, 2.0])
    corrected = memory.corrected(g, key=0)
    memory.remember(0, corrected, sent=torch.tensor([1.0, 0.0]))
    assert memory.corrected(g, key=0).tolist() == [1.0, 4.0]
    assert memory.corrected(g, key=1).tolist() == [1.0, 2.0]  # another bucket has its own memory


def test_an_unknown_compressor_lists_the_known_ones():
    with pytest.raises(UserError, match="comm.compressor='nope' is not valid; choose one of"):
        make_compressor("nope")

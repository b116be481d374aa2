"""Cluster specs from the command line (pure: no namespaces)."""

import pytest

from paraloom.bench.allreduce_sweep import format_size, parse_sizes
from paraloom.cluster import ClusterSpec, parse_emulate, parse_rate
from paraloom.cluster.spec import format_rate
from paraloom.config.errors import UserError


@pytest.mark.parametrize(("text", "bits"), [("1gbit", 10**9), ("100mbit", 10**8), ("10Gbit", 10**10),
                                            ("2.5gbit", 25 * 10**8), ("500kbit", 5 * 10**5)])
def test_rates(text, bits):
    assert parse_rate(text) == bits
    assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["1gb", "fast", "", "1 tbit", "10bit", "1000gbit"])
def test_bad_rates(text):
    with pytest.raises(UserError):
        parse_rate(text)


def test_emulate():
    spec = parse_emulate("4x1gbit")
    assert (spec.nodes, spec.rate_bits, spec.rate) == (4, 10**9, "1gbit")
    for bad in ("4x", "x1gbit", "1x1gbit", "65x1gbit", "fourx1gbit", "4*1gbit"):
        with pytest.raises(UserError):
            parse_emulate(bad)
    with pytest.raises(UserError, match="lowercase"):
        ClusterSpec(2, 10**9, name="Bad-Name")


def test_sizes():
    assert parse_sizes("1KB..64KB") == [1024, 4096, 16384, 65536]
    assert parse_sizes("1MB,16MB,1MB") == [2**20, 2**24]
    assert [format_size(s) for s in parse_sizes("1KB..64MB")][-3:] == ["4MB", "16MB", "64MB"]
    for bad in ("1TB", "64MB..1KB", "2B..1KB", ""):
        with pytest.raises(UserError):
            parse_sizes(bad)

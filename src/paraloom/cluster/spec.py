"""Cluster specs from the command line: `--nodes 4 --bandwidth 1gbit` or `--emulate 4x1gbit`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from paraloom.config.errors import UserError

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units: bits per second
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", re.IGNORECASE)
_NAME = re.compile(r"[a-z0-9]{1,8}")
MAX_NODES = 64


def parse_rate(text: str) -> int:
    """'1gbit' -> 1_000_000_000 bits/s (tc's units: bit, kbit, mbit, gbit)."""
    match = _RATE.fullmatch(text.strip())
    if not match:
        raise UserError(f"bandwidth {text!r} is not a rate; write e.g. 100mbit, 1gbit or 10gbit")
    bits = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 10**5 <= bits <= 10**11:
        raise UserError(f"bandwidth {text!r} is out of range; use 100kbit to 100gbit")
    return int(bits)


def format_rate(bits: int) -> str:
    for unit in ("gbit", "mbit", "kbit"):
        if bits >= _UNITS[unit] and bits % (_UNITS[unit] // 1000 or 1) == 0:
            value = bits / _UNITS[unit]
            return f"{value:g}{unit}"
    return f"{bits}bit"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise UserError(f"cluster name {name!r} must be 1-8 lowercase letters or digits")
    return name


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    rate_bits: int  # each node's link, each direction, bits per second
    name: str = "default"

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= MAX_NODES:
            raise UserError(f"--nodes {self.nodes} must be between 2 and {MAX_NODES}")
        check_name(self.name)

    @property
    def rate(self) -> str:
        return format_rate(self.rate_bits)


def parse_emulate(text: str, name: str = "emu") -> ClusterSpec:
    """'4x1gbit' -> 4 nodes on 1 Gbit/s links."""
    nodes, sep, rate = text.strip().partition("x")
    if not sep or not nodes.isdigit():
        raise UserError(f"--emulate {text!r} must look like NODESxRATE, e.g. 4x1gbit")
    return ClusterSpec(nodes=int(nodes), rate_bits=parse_rate(rate), name=name)

"""Trace tests' shared fixture: synthetic per-rank traces shaped like training steps."""

import pytest

from paraloom.trace import Timeline

PNG = b"\x89PNG\r\n\x1a\n"


def _synthetic_trace(run_dir, rank, *, steps=3, layers=3, origin_unix_s=1.7e9):
    """Write run_dir/trace/rank<r>.json: forward, backward and overlapping comm per step.

    Every rank's Timeline claims the same wall-clock start, and rank r begins r ms after it.
    """
    tl = Timeline(rank)
    tl.origin_unix_s = origin_unix_s
    tl.active = True
    t = tl.origin + 0.001 * rank
    for step in range(2, 2 + steps):
        begin = t
        for layer in range(layers):
            tl.span(f"forward {layer}", "compute", t, t + 0.002)
            t += 0.0025
        for layer in reversed(range(layers)):
            tl.span(f"backward {layer}", "compute", t, t + 0.003)
            tl.span(f"all_reduce bucket {layer}", "comm", t + 0.003, t + 0.006, nbytes=1 << 20)
            t += 0.0035
        t += 0.004
        tl.span(f"step {step}", "step", begin, t)
        t += 0.0005
    return tl.write(run_dir / "trace" / f"rank{rank}.json")


@pytest.fixture
def synthetic_trace():
    return _synthetic_trace


@pytest.fixture
def is_png():
    def check(path, *, min_bytes=1000):
        data = path.read_bytes()
        return len(data) >= min_bytes and data.startswith(PNG)

    return check

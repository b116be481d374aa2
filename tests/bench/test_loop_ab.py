"""benchmarks/loop_ab.py's bookkeeping: runs interleaved A B, B A after a warm-up each; ratios new / base."""

import importlib.util

import pytest
from scripts import ROOT


def load_loop_ab(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports benchmarks/common.py
    spec = importlib.util.spec_from_file_location("loop_ab", ROOT / "benchmarks" / "loop_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_alternate_and_ratios_are_new_over_base(monkeypatch):
    loop_ab = load_loop_ab(monkeypatch)
    calls = []

    def run_one(side, i):
        calls.append((side, i))
        return {"wall": (2.0 if side == "new" else 4.0) + i}

    runs = loop_ab.interleave(3, run_one)
    assert calls == [("new", -1), ("base", -1), ("new", 0), ("base", 0), ("base", 1), ("new", 1),
                     ("new", 2), ("base", 2)]
    assert runs == {"new/wall": [2.0, 3.0, 4.0], "base/wall": [4.0, 5.0, 6.0]}  # warm-ups dropped
    row = loop_ab.ratios(runs)["wall"]
    assert row["new"] == 3.0 and row["base"] == 5.0 and row["ratio"] == pytest.approx(0.6)
    assert row["pair_min"] == pytest.approx(0.5) and row["pair_max"] == pytest.approx(4 / 6)

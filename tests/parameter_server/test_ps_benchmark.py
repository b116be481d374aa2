"""benchmarks/ps.py: the issue's figures are read from the right runs."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ps_benchmark_summary_reads_the_runs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ps as bench
    finally:
        sys.path.pop(0)

    def row(samples, tta):
        return {"samples_per_s": samples, "tta_s": tta}

    report = {"stragglers": {
        "transient": {"bsp": row(100, 10.0), "ssp3": row(150, 8.0), "asp": row(160, None),
                      "allreduce": row(300, 3)},
        "persistent": {"bsp": row(100, 12.0), "asp": row(170, 9.0), "allreduce": row(200, 6)}},
        "servers": {"k1": row(50, None), "k4": row(110, None)}}
    summary = bench.summarize(report)
    assert summary["ssp3_vs_bsp_throughput"] == 1.5 and summary["asp_vs_bsp_throughput"] == 1.7
    assert summary["k4_vs_k1_throughput"] == 2.2 and summary["allreduce_vs_bsp_throughput_transient"] == 3
    assert summary["ssp3_tta_s"] == 8.0 and summary["bsp_tta_s"] == 10.0

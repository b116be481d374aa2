"""Measurement that fills the cost formulas: model profiles on the meta device, micro-benchmarks,
calibration of this machine (links timed by functions its caller hands in), device profiles, and
the rechecks after a run."""

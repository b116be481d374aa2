"""Benchmark workers launched under the elastic agent (torchrun), and the one harness that runs them."""

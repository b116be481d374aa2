"""What a CPU spends on each op beyond its arithmetic: dispatch and autograd bookkeeping, measured by
`paraloom calibrate` and priced by `device_cost`.

On a GPU the host issues ops while the device computes earlier ones, so issuing them only bounds a
layer from below (`host_s.*`). On a CPU the core that computes an op also dispatches it, records it
for autograd and, in backward, runs the autograd engine around it: those seconds add to the op's
arithmetic (`dispatch_s.*`). They are much of a small model's step on a CPU: the default job's
150 k-parameter CNN dispatches 10 ops forward and 14 backward a micro-batch, 0.5 to 1 ms of its
7-10 ms step on this project's 2-core machine, depending on the calibration.
"""

from __future__ import annotations

import torch

from paraloom.perfmodel.cost.device import DISPATCH
from paraloom.perfmodel.measure.microbench import host_costs


def measure_host(threads: int = 1, min_s: float = 0.02) -> dict[str, float]:
    """This CPU's `dispatch_s.<op class>.<fwd|bwd>` on `threads` threads: the seconds one op costs
    beyond its arithmetic, timed on ops too small to compute (`microbench.host_costs`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {f"{DISPATCH}.{op}.{phase}": seconds
                for op, phases in host_costs(torch.device("cpu"), min_s=min_s).items()
                for phase, seconds in phases.items()}
    finally:
        torch.set_num_threads(previous)

"""Whether this machine still computes at its cached profile's rates: what a compute term off means.

A run's compute can miss its prediction for two reasons that call for opposite remedies: the machine
computes slower (or faster) than when its profile was calibrated, and calibrating again fixes the
prediction; or the machine is as calibrated and the model prices this model's layers wrongly (a CPU's
per-op costs of small layers, few-channel convolutions, pooling), which no calibration changes.
`compute_check` tells them apart by measuring the profile's micro-benchmarks again, after the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

SLOWER, FASTER = 0.8, 1.25  # the machine has changed where its rates' median ratio leaves this band
RESCALED_FITS = 0.25  # and that alone explains the miss where the rescaled prediction comes this close


def compute_check(predicted: dict[str, Any], measured_compute: float, *,
                  measure: Callable[[int], dict[str, float]] | None = None,
                  progress: Callable[[str], None] = lambda _: None) -> str:
    """One line on a run whose compute term was off, where the prediction came from this machine's
    cached CPU profile (`hardware_file`, `hardware_threads`): the profile's rates measured again on
    as many threads (`measure`, by default `calibrate.measure_compute`) beside the profile's, and
    which remedy follows. "" where the prediction did not come from such a profile."""
    path, threads = predicted.get("hardware_file"), predicted.get("hardware_threads")
    if not path or not threads or not Path(path).is_file():
        return ""
    from paraloom.perfmodel.hardware import OP_CLASSES, load_hardware

    if measure is None:
        from paraloom.perfmodel.calibrate import measure_compute as measure
    hw = load_hardware(path)
    progress("compute was off: measuring this machine's rates again (a few seconds)")
    now = measure(threads)
    ratios = {c: now[c] / hw.achieved_flops("fp32", c) for c in OP_CLASSES}
    ratios["bandwidth"] = now["bandwidth"] / hw.device.mem_bandwidth
    share = statistics.median(ratios.values())
    rates = ", ".join(f"{name} {ratio:.0%}" for name, ratio in ratios.items())
    predicted_compute = predicted["terms"]["compute"]
    rescaled = predicted_compute / share  # the prediction at the rates measured now
    layers = (f"this model's forward and backward cost {'more' if measured_compute > rescaled else 'less'} "
              "than the model prices them on this CPU (it does not price the per-op costs of small layers, "
              "few-channel convolutions or pooling apart)")
    if SLOWER <= share <= FASTER:
        return (f"this machine still computes at its profile's rates ({rates}): {layers}, and calibrating "
                "again would not change that")
    change = "slower" if share < SLOWER else "faster"
    machine = (f"this machine now computes at {share:.0%} of its profile's rates ({rates}), {change} than "
               "when it was calibrated (other load then or now, or another machine under the same name): "
               f"delete {path} to calibrate again on the next run")
    if abs(measured_compute - rescaled) <= RESCALED_FITS * measured_compute:
        return machine
    return (f"{machine}; that accounts for {(rescaled - predicted_compute) * 1e3:+.2f} ms of the "
            f"{(measured_compute - predicted_compute) * 1e3:+.2f} ms missed; for the rest, {layers}")

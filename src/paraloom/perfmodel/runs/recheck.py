"""Whether this machine still computes at its cached profile's rates: what a compute or update miss means.

A run's compute (or optimizer step) can miss its prediction for two reasons that call for opposite
remedies: the machine computes slower (or faster) than when its profile was calibrated, and
calibrating again fixes the prediction; or the machine is as calibrated and the model prices this
model's work wrongly on a CPU (few-channel convolutions, pooling, shapes its micro-benchmarks do not run;
torch's per-tensor work in an optimizer step), which no calibration changes. `machine_check` tells
them apart by measuring the profile's micro-benchmarks again, after the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paraloom.perfmodel.runs.contract import RECHECKED

SLOWER, FASTER = 0.8, 1.25  # the machine has changed where its rates' ratio leaves this band
# the profile's micro-benchmarks at a fifth of calibration's sample length: 0.5 s in all, not 2 s (on
# the 2-core machine the median ratio moved by 0.07 between such checks, by 0.03 at calibration's)
CHECK_MIN_S = 0.01
CONFIRMS = 2  # more samples before a rate is taken to have slowed
RESCALED_FITS = 0.25  # and that alone explains the miss where the rescaled prediction comes this close
# what the CPU model leaves out of each, which a machine measuring as calibrated points to
UNPRICED = {"compute": ("this model's forward and backward cost", "them",
                        "the rates of few-channel convolutions, pooling or other shapes its micro-benchmarks "
                        "do not run"),
            "update": ("the optimizer step costs", "it",
                       "torch's work per parameter tensor: it prices the bytes moved at memory bandwidth")}


def machine_check(predicted: dict[str, Any], measured: dict[str, float], off: set[str], *,
                  measure: Callable[[int], dict[str, float]] | None = None,
                  progress: Callable[[str], None] = lambda _: None) -> dict[str, str]:
    """Term -> one line, for each of compute and update in `off` (off, or behind a spread miss),
    where the prediction came from this machine's cached CPU profile (`hardware_file`,
    `hardware_threads`): the profile's rates measured again on as many threads (`measure`, by default
    `calibrate.measure_compute`) beside the profile's, and which remedy follows. Empty where there is
    no such profile or no such term."""
    path, threads = predicted.get("hardware_file"), predicted.get("hardware_threads")
    terms = [term for term in RECHECKED if term in off]
    if not terms or not path or not threads or not Path(path).is_file():
        return {}
    from paraloom.perfmodel.cost.device import UPDATE_PER_PARAM
    from paraloom.perfmodel.hardware import OP_CLASSES, load_hardware

    if measure is None:
        from paraloom.perfmodel.measure.calibrate import measure_compute

        def measure(threads: int) -> dict[str, float]:
            return measure_compute(threads, min_s=CHECK_MIN_S)
    hw = load_hardware(path)
    if any(key.startswith(UPDATE_PER_PARAM) for key in hw.constants):  # torch's own step measured
        terms = [term for term in terms if term != "update"]
    if not terms:
        return {}
    progress(f"{' and '.join(terms)} missed {'its' if len(terms) == 1 else 'their'} prediction: measuring "
             "this machine's rates again (about a second)")
    profiled = {**{c: hw.achieved_flops("fp32", c) for c in OP_CLASSES}, "bandwidth": hw.device.mem_bandwidth}
    now = measure(threads)
    for attempt in range(1 + CONFIRMS):
        ratios = {k: now[k] / profiled[k] for k in profiled}
        # compute: the median over the op classes and bandwidth; the update is bytes at memory bandwidth
        shares = {"compute": statistics.median(ratios.values()), "update": ratios["bandwidth"]}
        if attempt == CONFIRMS or min(shares[term] for term in terms) >= SLOWER:
            break
        again = measure(threads)  # found slower: measured again, each rate its best sample (a sample can
        now = {k: max(now[k], again[k]) for k in now}  # be slowed by chance, never sped up)
    rates = ", ".join(f"{name} {ratio:.0%}" for name, ratio in ratios.items())
    shown = {"compute": rates, "update": f"bandwidth {ratios['bandwidth']:.0%}"}
    return {term: _verdict(term, shares[term], shown[term], predicted["terms"][term], measured[term], path)
            for term in terms}


def _verdict(term: str, share: float, rates: str, predicted: float, measured: float, path: str) -> str:
    what, pronoun, unpriced = UNPRICED[term]
    rescaled = predicted / share  # the prediction at the rates measured now
    model = (f"{what} {'more' if measured > rescaled else 'less'} than the model prices {pronoun} on "
             f"this CPU (it does not price {unpriced})")
    rate = "computes at" if term == "compute" else "copies memory at"  # the update: bytes at bandwidth
    if SLOWER <= share <= FASTER:
        return (f"{term}: this machine still {rate} its profile's rates ({rates}): {model}, and "
                "calibrating again would not change that")
    change = "slower" if share < SLOWER else "faster"
    machine = (f"{term}: this machine now {rate} {share:.0%} of its profile's rates ({rates}), {change} "
               "than when it was calibrated (other load then or now, or another machine under the same "
               f"name): delete {path} to calibrate again on the next run")
    if abs(measured - rescaled) <= RESCALED_FITS * measured:
        return machine
    return (f"{machine}; that accounts for {(rescaled - predicted) * 1e3:+.2f} ms of the "
            f"{(measured - predicted) * 1e3:+.2f} ms missed; for the rest, {model}")

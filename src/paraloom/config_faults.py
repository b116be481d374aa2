"""The `run.inject` fault specs: parsed and checked before any worker starts (torch-free).

See `paraloom.train.faults` for what each fault does when it fires.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraloom.choices import FAULT_KINDS as KINDS
from paraloom.errors import UserError


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: a random rank each step (slow only)
    step: int | None = None
    factor: float = 1.0

    def text(self) -> str:
        rank = "random" if self.rank is None else self.rank
        tail = f"step={self.step}" if self.step is not None else f"factor={self.factor:g}"
        return f"{self.kind}:rank={rank},{tail}"


def parse_faults(text: str) -> list[Fault]:
    faults = [_parse_one(part.strip()) for part in text.split(";") if part.strip()]
    if not faults:
        raise UserError("run.inject is empty; give e.g. kill:rank=1,step=30")
    return faults


def _parse_one(spec: str) -> Fault:
    kind, sep, rest = spec.partition(":")
    if kind not in KINDS:
        raise UserError(f"--inject {spec!r}: unknown fault {kind!r}; choose one of: {', '.join(KINDS)}")
    wanted = KINDS[kind]
    values: dict[str, str] = {}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.strip().partition("=")
        if not eq or key not in wanted or key in values:
            raise UserError(f"--inject {spec!r}: expected {kind}:" + ",".join(f"{k}=..." for k in wanted))
        values[key] = value.strip()
    if set(values) != set(wanted):
        raise UserError(f"--inject {spec!r}: expected {kind}:" + ",".join(f"{k}=..." for k in wanted))
    rank_text = values["rank"]
    if rank_text == "random" and kind == "slow":
        rank = None
    elif rank_text.isdigit():
        rank = int(rank_text)
    else:
        allowed = "a rank number or 'random'" if kind == "slow" else "a rank number"
        raise UserError(f"--inject {spec!r}: rank must be {allowed}, got {rank_text!r}")
    if kind in ("slow", "slow_data"):
        try:
            factor = float(values["factor"])
        except ValueError:
            raise UserError(f"--inject {spec!r}: factor must be a number, got {values['factor']!r}") from None
        if not 1.0 <= factor <= 100.0:
            raise UserError(f"--inject {spec!r}: factor must lie in [1, 100], got {factor:g}")
        return Fault(kind, rank, factor=factor)
    if not values["step"].isdigit() or int(values["step"]) < 1:
        raise UserError(f"--inject {spec!r}: step must be a whole number >= 1, got {values['step']!r}")
    return Fault(kind, rank, step=int(values["step"]))


def check_faults(faults: list[Fault], world_size: int, total_steps: int | None = None) -> None:
    """Refuse ranks outside the world and steps past the end of the run."""
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            raise UserError(f"--inject {fault.text()}: rank {fault.rank} is out of range; "
                            f"this run has ranks 0..{world_size - 1}")
        if fault.step is not None and total_steps is not None and fault.step > total_steps:
            raise UserError(f"--inject {fault.text()}: step {fault.step} is out of range; "
                            f"this run has steps 1..{total_steps}")

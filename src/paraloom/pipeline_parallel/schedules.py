"""Pipeline schedules as pure data: per-stage action lists ("F0", "B3"), validated, simulated, printed."""

from __future__ import annotations

from typing import NamedTuple

from paraloom.errors import UserError


class Action(NamedTuple):
    """One unit of pipeline work: forward ("F") or backward ("B") of micro-batch `microbatch`."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str | Action) -> Action:
        """`Action.parse("B3") == Action("B", 3)`; an `Action` passes through."""
        if isinstance(text, Action):
            return text
        if not (isinstance(text, str) and len(text) > 1 and text[0] in "FB" and text[1:].isdigit()):
            raise UserError(f"pipeline action {text!r} is not understood; write 'F<i>' or 'B<i>', e.g. 'F0'")
        return cls(text[0], int(text[1:]))


Schedule = list[list[Action]]  # actions per stage, in the order each stage runs them


def F(i: int) -> Action:  # noqa: N802 - reads like the notation
    return Action("F", i)


def B(i: int) -> Action:  # noqa: N802
    return Action("B", i)


class ScheduleGPipe:
    """GPipe (Huang et al. 2019): every forward, then every backward (flush at the end of the step)."""

    name = "gpipe"

    def stage_actions(self, stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
        return [F(i) for i in range(n_microbatches)] + [B(i) for i in range(n_microbatches)]


class Schedule1F1B:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): p - stage - 1 warm-up forwards, then alternate
    one forward and one backward, then the remaining backwards; at most p - stage micro-batches in flight."""

    name = "1f1b"

    def stage_actions(self, stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
        m = n_microbatches
        warmup = min(n_stages - stage - 1, m)
        out = [F(i) for i in range(warmup)]
        for i in range(m - warmup):
            out += [F(warmup + i), B(i)]
        return out + [B(i) for i in range(m - warmup, m)]


class ScheduleLayers(ScheduleGPipe):
    """Plain model parallelism: consecutive layers on consecutive ranks, the whole batch at once (m = 1)."""

    name = "layers"

    def stage_actions(self, stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
        if n_microbatches != 1:
            raise UserError(f"schedule 'layers' runs the whole batch as one micro-batch, got "
                            f"n_microbatches={n_microbatches}; use 1, or schedule 'gpipe' or '1f1b'")
        return super().stage_actions(stage, n_stages, 1)


SCHEDULES = {cls.name: cls for cls in (ScheduleGPipe, Schedule1F1B, ScheduleLayers)}


def make_schedule(name: str, n_stages: int, n_microbatches: int) -> Schedule:
    """The actions of every stage for schedule `name` with `n_stages` stages and `n_microbatches`."""
    if name not in SCHEDULES:
        raise UserError(f"pipeline schedule {name!r} is not known; choose one of: {', '.join(SCHEDULES)}")
    for what, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"pipeline {what}={value!r} must be a positive integer")
    impl = SCHEDULES[name]()
    return [impl.stage_actions(s, n_stages, n_microbatches) for s in range(n_stages)]


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of GPipe and 1F1B in theory: (p - 1) / (m + p - 1) (GPipe paper, section 2.3)."""
    return (p - 1) / (m + p - 1)


class Placed(NamedTuple):
    stage: int
    action: Action
    start: float
    end: float


def simulate(schedule: Schedule, f_time: float = 1.0, b_time: float = 1.0) -> tuple[list[Placed], list[int]]:
    """Run the schedule on an ideal machine: each stage does its actions in order, stage s's F_i
    after stage s-1's F_i, B_i after stage s+1's B_i (and after its own F_i). Returns the placed
    actions and, per stage, how many actions ran (fewer than listed: the schedule deadlocks)."""
    p = len(schedule)
    done: dict[tuple[int, Action], float] = {}  # (stage, action) -> end time
    ran, free, placed = [0] * p, [0.0] * p, []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while ran[s] < len(schedule[s]):
                a = Action.parse(schedule[s][ran[s]])
                deps = []
                if a.kind == "F" and s > 0:
                    deps.append((s - 1, a))
                if a.kind == "B":
                    deps.append((s, F(a.microbatch)))
                    if s < p - 1:
                        deps.append((s + 1, a))
                if any(d not in done for d in deps):
                    break
                start = max([free[s], *(done[d] for d in deps)])
                end = start + (f_time if a.kind == "F" else b_time)
                done.setdefault((s, a), end)
                placed.append(Placed(s, a, start, end))
                free[s], ran[s], progress = end, ran[s] + 1, True
    return placed, ran


def idle_fraction(schedule: Schedule, f_time: float = 1.0, b_time: float = 1.0) -> float:
    """Simulated idle share of stage-time between the step's start and its last action's end."""
    placed, _ = simulate(schedule, f_time, b_time)
    makespan = max(pl.end for pl in placed)
    busy = sum(pl.end - pl.start for pl in placed)
    return 1 - busy / (makespan * len(schedule))


def format_grid(schedule: Schedule) -> str:
    """A time-by-stage grid of the schedule with unit-time actions ("." idle); stuck actions listed after."""
    placed, ran = simulate(schedule)
    makespan = int(max((pl.end for pl in placed), default=0))
    cells = [["."] * makespan for _ in schedule]
    for pl in placed:
        cells[pl.stage][int(pl.start)] = str(pl.action)
    width = max([2, *(len(c) for row in cells for c in row)])
    label = len(f"stage {len(schedule) - 1}")
    lines = [(" " * label + " | " + " ".join(f"{t:<{width}}" for t in range(makespan))).rstrip()]
    for s, row in enumerate(cells):
        line = f"{f'stage {s}':<{label}} | " + " ".join(f"{c:<{width}}" for c in row)
        stuck = [str(Action.parse(a)) for a in schedule[s][ran[s]:]]
        if stuck:
            line += "   stuck: " + " ".join(stuck)
        lines.append(line.rstrip())
    return "\n".join(lines)


def validate(schedule: Schedule, n_microbatches: int) -> None:
    """Raise UserError (with the grid) unless every stage forwards and backwards each micro-batch
    exactly once, F before B, and the stages together can run the schedule without deadlock."""
    problems = []
    for s, actions in enumerate(schedule):
        try:
            actions = [Action.parse(a) for a in actions]
        except UserError as e:
            problems.append(f"stage {s}: {e}")
            continue
        for kind in "FB":
            seen = [a.microbatch for a in actions if a.kind == kind]
            missing = sorted(set(range(n_microbatches)) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            extra = sorted({i for i in seen if not 0 <= i < n_microbatches})
            for what, ids in (("misses", missing), ("repeats", twice), ("has unknown", extra)):
                if ids:
                    problems.append(f"stage {s} {what} {kind} of micro-batch(es) {ids}")
        for i in range(n_microbatches):
            if B(i) in actions and F(i) in actions and actions.index(B(i)) < actions.index(F(i)):
                problems.append(f"stage {s} runs B{i} before F{i}")
    if not problems:
        _, ran = simulate(schedule)
        stuck = [s for s, actions in enumerate(schedule) if ran[s] < len(actions)]
        if stuck:
            problems.append(f"the schedule deadlocks: stage(s) {stuck} wait for work that never comes "
                            "(stage s's F_i needs stage s-1's F_i; B_i needs stage s+1's B_i)")
    if problems:
        try:
            grid = format_grid(schedule)
        except UserError:
            grid = "\n".join(f"stage {s}: {' '.join(map(str, a))}" for s, a in enumerate(schedule))
        raise UserError("invalid pipeline schedule: " + "; ".join(problems)
                        + "; fix the action lists:\n" + grid)

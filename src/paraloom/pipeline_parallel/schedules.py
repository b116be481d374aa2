"""Pipeline schedules as pure data: per-stage action lists ("F0", "B3"), validated, simulated, printed."""

from __future__ import annotations

from typing import NamedTuple

from paraloom.config.errors import UserError


class Action(NamedTuple):
    """One unit of pipeline work: forward ("F") or backward ("B") of micro-batch `microbatch` on
    model chunk `chunk` of this stage (interleaved schedules hold several; "F3.1": chunk 1)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str | Action) -> Action:
        """`Action.parse("B3") == Action("B", 3)`, `Action.parse("F2.1") == Action("F", 2, 1)`."""
        if isinstance(text, Action):
            return text
        body = text[1:] if isinstance(text, str) else ""
        number, _, chunk = body.partition(".")
        if not (isinstance(text, str) and text[:1] in ("F", "B") and number.isdigit()
                and (not chunk or chunk.isdigit())):
            raise UserError(f"pipeline action {text!r} is not understood; write 'F<i>' or 'B<i>', e.g. 'F0', "
                            "or 'F<i>.<chunk>' for a model chunk of an interleaved schedule")
        return cls(text[0], int(number), int(chunk or 0))


Schedule = list[list[Action]]  # actions per stage, in the order each stage runs them


def F(i: int, chunk: int = 0) -> Action:  # noqa: N802 - reads like the notation
    return Action("F", i, chunk)


def B(i: int, chunk: int = 0) -> Action:  # noqa: N802
    return Action("B", i, chunk)


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


class ScheduleInterleaved1F1B:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): each stage holds `v` model chunks,
    stage s chunk c being virtual stage c * p + s, so a micro-batch passes the ring of stages v
    times. A stage runs its forwards in groups of p micro-batches, chunk after chunk, and its
    backwards likewise with the chunks reversed; (p - s - 1) * 2 + (v - 1) * p warm-up forwards,
    then one forward and one backward alternately, then the remaining backwards. The bubble
    shrinks v-fold, to (p - 1) / (v m + p - 1) of the step; the sends grow v-fold. m must be a
    multiple of p (as in Megatron-LM)."""

    name = "interleaved_1f1b"

    def __init__(self, virtual_stages: int = 2) -> None:
        self.v = virtual_stages

    def stage_actions(self, stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
        p, v, m = n_stages, self.v, n_microbatches
        if m % p:
            raise UserError(f"schedule 'interleaved_1f1b' runs micro-batches in groups of the {p} stages; "
                            f"n_microbatches={m} is not a multiple of {p}")

        def unit(k: int, backward: bool) -> Action:
            chunk = (k // p) % v
            return Action("B" if backward else "F", (k // (p * v)) * p + k % p,
                          v - 1 - chunk if backward else chunk)

        total = m * v
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
        out = [unit(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            out += [unit(warmup + k, False), unit(k, True)]
        return out + [unit(k, True) for k in range(total - warmup, total)]


SCHEDULES = {cls.name: cls for cls in (ScheduleGPipe, Schedule1F1B, ScheduleLayers, ScheduleInterleaved1F1B)}


def make_schedule(name: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The actions of every stage for schedule `name` with `n_stages` stages and `n_microbatches`
    (and, for interleaved_1f1b, `virtual_stages` model chunks per stage)."""
    if name not in SCHEDULES:
        raise UserError(f"pipeline schedule {name!r} is not known; choose one of: {', '.join(SCHEDULES)}")
    for what, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"pipeline {what}={value!r} must be a positive integer")
    interleaved = SCHEDULES[name] is ScheduleInterleaved1F1B
    if virtual_stages > 1 and not interleaved:
        raise UserError(f"virtual_stages={virtual_stages} is for schedule 'interleaved_1f1b'; "
                        f"schedule {name!r} runs one model chunk per stage")
    impl = ScheduleInterleaved1F1B(virtual_stages) if interleaved else SCHEDULES[name]()
    return [impl.stage_actions(s, n_stages, n_microbatches) for s in range(n_stages)]


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction in theory: (p - 1) / (m + p - 1) for GPipe and 1F1B (GPipe paper, section 2.3),
    (p - 1) / (v m + p - 1) for interleaved 1F1B with v chunks per stage (Narayanan et al. 2021)."""
    return (p - 1) / (v * m + p - 1)


def chunks_of(schedule: Schedule) -> int:
    """How many model chunks a stage of the schedule holds (1 but for interleaved schedules)."""
    return 1 + max((Action.parse(a).chunk for actions in schedule for a in actions), default=0)


class Placed(NamedTuple):
    stage: int
    action: Action
    start: float
    end: float


def simulate(schedule: Schedule, f_time: float = 1.0, b_time: float = 1.0,
             scale: list[float] | None = None) -> tuple[list[Placed], list[int]]:
    """Run the schedule on an ideal machine: each stage does its actions in order; virtual stage u
    (chunk c of stage s is u = c p + s) forwards micro-batch i after virtual stage u - 1 did, and
    backwards it after virtual stage u + 1 did (and after its own forward); stage s's actions take
    `scale[s]` times the given times (default 1: equal stages). Returns the placed actions and, per
    stage, how many actions ran (fewer than listed: the schedule deadlocks)."""
    p = len(schedule)
    last = p * chunks_of(schedule) - 1  # the last virtual stage

    def at(u: int, kind: str, i: int) -> tuple[int, Action]:
        return u % p, Action(kind, i, u // p)

    done: dict[tuple[int, Action], float] = {}  # (stage, action) -> end time
    ran, free, placed = [0] * p, [0.0] * p, []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while ran[s] < len(schedule[s]):
                a = Action.parse(schedule[s][ran[s]])
                u = a.chunk * p + s
                deps = []
                if a.kind == "F" and u > 0:
                    deps.append(at(u - 1, "F", a.microbatch))
                if a.kind == "B":
                    deps.append((s, F(a.microbatch, a.chunk)))
                    if u < last:
                        deps.append(at(u + 1, "B", a.microbatch))
                if any(d not in done for d in deps):
                    break
                start = max([free[s], *(done[d] for d in deps)])
                end = start + (f_time if a.kind == "F" else b_time) * (scale[s] if scale else 1.0)
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


def idle_before(schedule: Schedule, f_time: float = 1.0, b_time: float = 2.0) -> list[list[bool]]:
    """Per stage and action: whether the ideal run (constant times, backward twice forward) leaves the
    stage idle just before the action -- the schedule's fill and drain. Everywhere else a stage that
    waits on a real machine waits for its neighbours' uneven compute, not for the schedule. For GPipe,
    1F1B and interleaved 1F1B at p = 2 the positions are the same for any backward/forward ratio of
    1.5 to 3 (tests); interleaved at p >= 4 moves a few of them with the ratio."""
    placed, _ = simulate(schedule, f_time, b_time)
    idle: list[list[bool]] = [[] for _ in schedule]
    free = [0.0] * len(schedule)
    for pl in sorted(placed, key=lambda pl: pl.start):
        idle[pl.stage].append(pl.start > free[pl.stage] + 1e-9)
        free[pl.stage] = pl.end
    return idle


def fill_drain_shares(schedule: Schedule, scale: list[float], f_time: float = 1.0,
                      b_time: float = 2.0) -> list[float]:
    """Per stage, the share of the step it idles before the actions `idle_before` marks (the fill and
    drain of equal stages) and after its last action, in the ideal run whose stage s computes
    `scale[s]` times as long as an equal stage. With equal stages every share is the theory's
    bubble; a first stage that computes more idles less there, as the later ones run ahead of it
    (interleaved 1F1B at p = 2, m = 8: 2% busier than the last stage, it loses a quarter of it),
    while a busier last stage's share barely moves."""
    placed, _ = simulate(schedule, f_time, b_time, scale)
    marks = idle_before(schedule, f_time, b_time)
    makespan = max(pl.end for pl in placed)
    shares = []
    for s in range(len(schedule)):
        mine = sorted((pl for pl in placed if pl.stage == s), key=lambda pl: pl.start)
        free, idle = 0.0, 0.0
        for k, pl in enumerate(mine):
            idle += (pl.start - free) if marks[s][k] else 0.0
            free = pl.end
        shares.append((idle + makespan - free) / makespan)
    return shares


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
    try:
        v = chunks_of(schedule)
    except UserError as e:
        v, problems = 1, [str(e)]
    units = [(i, c) for i in range(n_microbatches) for c in range(v)]
    for s, actions in enumerate(schedule):
        try:
            actions = [Action.parse(a) for a in actions]
        except UserError as e:
            problems.append(f"stage {s}: {e}")
            continue
        for kind in "FB":
            seen = [(a.microbatch, a.chunk) for a in actions if a.kind == kind]
            missing = sorted(set(units) - set(seen))
            twice = sorted({u for u in seen if seen.count(u) > 1})
            extra = sorted({u for u in seen if u not in units})
            for what, found in (("misses", missing), ("repeats", twice), ("has unknown", extra)):
                if found:
                    ids = [i for i, _ in found] if v == 1 else [f"{i}.{c}" for i, c in found]
                    problems.append(f"stage {s} {what} {kind} of micro-batch(es) {ids}")
        for i, c in units:
            if B(i, c) in actions and F(i, c) in actions and actions.index(B(i, c)) < actions.index(F(i, c)):
                problems.append(f"stage {s} runs {B(i, c)} before {F(i, c)}")
    if not problems:
        _, ran = simulate(schedule)
        stuck = [s for s, actions in enumerate(schedule) if ran[s] < len(actions)]
        if stuck:
            problems.append(f"the schedule deadlocks: stage(s) {stuck} wait for work that never comes "
                            "(stage s's F_i needs stage s-1's F_i; B_i needs stage s+1's B_i; with "
                            "chunks, virtual stage c p + s for chunk c)")
    if problems:
        try:
            grid = format_grid(schedule)
        except UserError:
            grid = "\n".join(f"stage {s}: {' '.join(map(str, a))}" for s, a in enumerate(schedule))
        raise UserError("invalid pipeline schedule: " + "; ".join(problems)
                        + "; fix the action lists:\n" + grid)

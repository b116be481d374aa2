"""Pipeline schedules as pure data: literal action lists, validation failures, grids, bubble fractions."""

import pytest

from paraloom.config.errors import UserError
from paraloom.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    Schedule1F1B,
    ScheduleGPipe,
    bubble_fraction,
    fill_drain_shares,
    format_grid,
    idle_before,
    idle_fraction,
    make_schedule,
    simulate,
    validate,
)


def names(actions):
    return " ".join(map(str, actions))


def test_action_text():
    assert str(Action("F", 0)) == "F0" and str(Action("B", 13)) == "B13"
    assert Action.parse("B3") == Action("B", 3)
    assert Action.parse(Action("F", 2)) == Action("F", 2)
    for bad in ("X1", "F", "Fx", "", 3):
        with pytest.raises(UserError, match="F<i>"):
            Action.parse(bad)


def test_registry_keys():
    assert SCHEDULES["gpipe"] is ScheduleGPipe and SCHEDULES["1f1b"] is Schedule1F1B
    assert set(SCHEDULES) == {"gpipe", "1f1b", "layers", "interleaved_1f1b"}


def test_1f1b_p4_m8():
    s = make_schedule("1f1b", 4, 8)
    assert names(s[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert names(s[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert names(s[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_1f1b_fewer_microbatches_than_stages():
    s = make_schedule("1f1b", 4, 2)
    assert names(s[0]) == "F0 F1 B0 B1"  # warm-up capped at m
    assert names(s[2]) == "F0 F1 B0 B1"  # one warm-up forward, then 1F1B
    assert names(s[3]) == "F0 B0 F1 B1"


def test_gpipe_and_layers():
    assert [names(a) for a in make_schedule("gpipe", 2, 3)] == ["F0 F1 F2 B0 B1 B2"] * 2
    assert [names(a) for a in make_schedule("layers", 3, 1)] == ["F0 B0"] * 3
    with pytest.raises(UserError, match="use 1, or schedule 'gpipe' or '1f1b'"):
        make_schedule("layers", 2, 4)


def test_unknown_name_lists_valid_names():
    with pytest.raises(UserError, match="choose one of: gpipe, 1f1b, layers"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(UserError, match="n_microbatches=0"):
        make_schedule("gpipe", 2, 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_generated_schedules_are_valid(name, p, m):
    validate(make_schedule(name, p, m), m)


def test_grid_gpipe():
    assert format_grid(make_schedule("gpipe", 2, 2)) == (
        "        | 0  1  2  3  4  5\n"
        "stage 0 | F0 F1 .  .  B0 B1\n"
        "stage 1 | .  F0 F1 B0 B1 .")


def test_grid_1f1b():
    assert format_grid(make_schedule("1f1b", 3, 3)) == (
        "        | 0  1  2  3  4  5  6  7  8  9\n"
        "stage 0 | F0 F1 F2 .  .  B0 .  B1 .  B2\n"
        "stage 1 | .  F0 F1 .  B0 F2 B1 .  B2 .\n"
        "stage 2 | .  .  F0 B0 F1 B1 F2 B2 .  .")


@pytest.mark.parametrize("schedule, m, message", [
    ([["F0", "B0"], ["F0"]], 1, "stage 1 misses B of micro-batch(es) [0]"),
    ([["F0", "F0", "B0"], ["F0", "B0"]], 1, "stage 0 repeats F of micro-batch(es) [0]"),
    ([["F0", "F1", "B0", "B1"], ["F0", "F2", "B0", "B1"]], 2, "stage 1 has unknown F of micro-batch(es) [2]"),
    ([["B0", "F0"], ["F0", "B0"]], 1, "stage 0 runs B0 before F0"),
    ([["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]], 2, "deadlocks: stage(s) [0, 1]"),
    ([["F0", "Q0"]], 1, "'Q0' is not understood"),
])
def test_validation_failures(schedule, m, message):
    with pytest.raises(UserError, match="invalid pipeline schedule") as err:
        validate(schedule, m)
    assert message in str(err.value)
    assert "stage 0 |" in str(err.value) or "stage 0:" in str(err.value)  # the grid comes with it


def test_deadlock_grid_shows_stuck_actions():
    grid = format_grid([["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]])
    assert grid.splitlines()[1:] == ["stage 0 | F0   stuck: B0 F1 B1", "stage 1 | .    stuck: F1 F0 B0 B1"]


def test_reordered_but_feasible_schedule_is_valid():
    validate([["F0", "F1", "B1", "B0"], ["F1", "F0", "B0", "B1"]], 2)  # odd, but nothing waits forever


def test_simulated_dependencies():
    placed, ran = simulate(make_schedule("1f1b", 2, 2), f_time=1, b_time=2)
    assert ran == [4, 4]
    when = {(pl.stage, str(pl.action)): (pl.start, pl.end) for pl in placed}
    assert when[(1, "F0")] == (1, 2) and when[(1, "B0")] == (2, 4) and when[(0, "B0")] == (4, 6)


def test_fill_and_drain_per_stage_of_unequal_stages():
    # 1F1B, p = 2, m = 1, stage 1 twice as slow: stage 0 F [0, 1], stage 1 F [1, 3] B [3, 7], stage 0
    # B [7, 9]; stage 0 waits 6 before its B, stage 1 waits 1 before its F and 2 after its B
    assert fill_drain_shares(make_schedule("1f1b", 2, 1), [1.0, 2.0]) == pytest.approx([6 / 9, 3 / 9])
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        equal = fill_drain_shares(make_schedule(name, 2, 8, v), [1.0, 1.0])
        assert equal == pytest.approx([bubble_fraction(2, 8, v)] * 2)
    # interleaved: the busier stage's fill and drain shrinks fast, the other's stays near theory
    busier, other = fill_drain_shares(make_schedule("interleaved_1f1b", 2, 8, 2), [1.01, 0.99])
    theory = bubble_fraction(2, 8, 2)
    assert busier < 0.8 * theory and other == pytest.approx(theory, rel=0.05)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(1, 4), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (8, 16)])
def test_idle_fraction_matches_theory(name, p, m):
    """Unit forward, 2-unit backward: simulated idle share is (p - 1) / (m + p - 1)."""
    simulated = idle_fraction(make_schedule(name, p, m), f_time=1, b_time=2)
    assert simulated == pytest.approx(bubble_fraction(p, m))


def test_bubble_fraction_values():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 2), (4, 8, 2), (4, 4, 3), (2, 2, 2), (8, 16, 4)])
def test_interleaved_1f1b_is_valid_and_its_bubble_shrinks_v_fold(p, m, v):
    schedule = make_schedule("interleaved_1f1b", p, m, v)
    validate(schedule, m)
    assert all(len(actions) == 2 * m * v for actions in schedule)
    assert idle_fraction(schedule) == pytest.approx(bubble_fraction(p, m, v))
    assert bubble_fraction(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert idle_fraction(schedule) < idle_fraction(make_schedule("1f1b", p, m))


def test_interleaved_order_and_notation():
    stage0 = make_schedule("interleaved_1f1b", 2, 4, 2)[0]
    # warm-up: (p - s - 1) * 2 + (v - 1) * p = 4 forwards, a group of p micro-batches per chunk
    assert [str(a) for a in stage0[:6]] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1"]
    assert Action.parse("F2.1") == Action("F", 2, 1) and str(Action("B", 3, 2)) == "B3.2"
    assert "F0.1" in format_grid(make_schedule("interleaved_1f1b", 2, 2, 2))
    with pytest.raises(UserError, match="n_microbatches=3 is not a multiple of 2"):
        make_schedule("interleaved_1f1b", 2, 3, 2)
    with pytest.raises(UserError, match="virtual_stages=2 is for schedule 'interleaved_1f1b'"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(UserError, match="misses B of micro-batch.*1.1"):
        validate([[a for a in stage0 if a != Action("B", 1, 1)]], 4)


def marked(schedule, idle):
    rows = zip(schedule, idle, strict=True)
    return [" ".join(str(a) for a, i in zip(actions, row, strict=True) if i) for actions, row in rows]


def test_idle_before_marks_the_fill_and_drain():
    """Only the waits the ideal run has: stage 0 for its first gradient and (1F1B) its last, stage 1 for
    its first activation."""
    assert marked(make_schedule("1f1b", 2, 4), idle_before(make_schedule("1f1b", 2, 4))) == ["B0 B3", "F0"]
    assert marked(make_schedule("gpipe", 2, 4), idle_before(make_schedule("gpipe", 2, 4))) == ["B0", "F0"]
    interleaved = make_schedule("interleaved_1f1b", 2, 8, 2)
    assert marked(interleaved, idle_before(interleaved, 0.5, 1.0)) == ["B0.1 B6.1 B7.1", "F0"]


@pytest.mark.parametrize(("name", "p", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 8, 1),
                                                   ("interleaved_1f1b", 2, 8, 2)])
def test_idle_before_is_the_same_for_any_backward_to_forward_ratio(name, p, m, v):
    """(Interleaved at p = 4 moves a few positions with the ratio: the runtime assumes 2.)"""
    schedule = make_schedule(name, p, m, v)
    assert all(idle_before(schedule, 1.0, ratio) == idle_before(schedule) for ratio in (1.5, 2.5, 3.0))

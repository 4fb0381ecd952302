"""Whether a batch step speculates, whether a joining prompt keeps to the decoding
rows' pace, and how much of it rides their step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from seatd.batch_policy import (
    PROBE_EVERY,
    SETTLED,
    StepCosts,
    StepPlan,
    catch_up_due,
    decide_step,
    drafter_due,
    paced,
    plan_step,
    probe_every,
    ride_tokens,
    size_class,
    speculates,
)


@pytest.mark.parametrize(("batch", "cls"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8),
                                            (9, 16), (16, 16), (17, 32)])
def test_size_classes(batch: int, cls: int) -> None:
    assert size_class(batch) == cls


def costs(**times: float) -> StepCosts:
    """times: p<class>=plain step seconds, v<class>_<width>=verify step seconds."""
    c = StepCosts()
    for name, t in times.items():
        if name.startswith("p"):
            key = (int(name[1:]), 1)
        else:
            size, width = name[1:].split("_")
            key = (int(size), int(width))
        c.seconds[key] = t
        c.timed[key] = SETTLED
    return c


@pytest.mark.parametrize(("wants", "batch", "c", "expected", "why"), [
    ([(0, 1.0), (0, 1.0)], 2, costs(p2=0.02), [0, 0], "nobody drafts"),
    ([(3, 2.5)], 1, costs(), [3], "a row alone follows its own policy"),
    ([(3, 2.5)], 1, costs(p1=0.01, v1_4=1.0), [3], "alone, even where a batch would not"),
    ([(3, 2.5), (2, 2.0)], 2, costs(), [0, 0], "plain step unmeasured: measure it first"),
    ([(3, 2.5), (2, 2.0)], 2, costs(p2=0.02), [3, 2], "verify unmeasured at this size: try"),
    ([(3, 2.5), (2, 2.0)], 2, costs(p2=0.02, v2_4=0.03), [3, 2], "4.5 / 30ms beats 2 / 20ms"),
    ([(3, 2.5), (2, 2.0)], 2, costs(p2=0.02, v2_4=0.05), [0, 0], "4.5 / 50ms loses to 2 / 20ms"),
    ([(3, 2.5), (0, 1.0)], 2, costs(p2=0.02, v2_4=0.03), [3, 0],
     "a row that does not draft rides along with one token"),
    ([(3, 1.2), (3, 1.2)] * 4, 8, costs(p8=0.05, v8_4=0.12), [0] * 8,
     "poor acceptance at batch 8: 9.6 / 120ms < 8 / 50ms"),
    ([(3, 2.8)] * 8, 8, costs(p8=0.05, v8_4=0.06), [3] * 8,
     "good acceptance with a cheap verify: 22.4 / 60ms > 8 / 50ms"),
])
def test_plan_step(wants: list[tuple[int, float]], batch: int, c: StepCosts,
                   expected: list[int], why: str) -> None:
    assert plan_step(wants, batch, c) == expected, why


@pytest.mark.parametrize(("wants", "batch", "c", "expected", "why"), [
    ([(3, 2.8)] * 8, 8, costs(p8=0.05, v8_4=0.06), [0] * 8,
     "a winning verify waits while a prompt joins at the rows' pace"),
    ([(3, 2.5), (2, 2.0)], 2, costs(p2=0.02), [0, 0],
     "no verify size tried while a step may carry the prompt (it could not be timed)"),
    ([(3, 2.5)], 1, costs(p1=0.01, v1_4=0.02), [3], "a row alone still follows its own"),
    ([(0, 1.0), (0, 1.0)], 2, costs(p2=0.02), [0, 0], "nobody drafts: plain either way"),
])
def test_plan_step_while_a_prompt_joins(wants: list[tuple[int, float]], batch: int,
                                        c: StepCosts, expected: list[int], why: str) -> None:
    assert plan_step(wants, batch, c, joining=True) == expected, why


@pytest.mark.parametrize(("wants", "batch", "c", "joining", "plan"), [
    ([(0, 1.0), (0, 1.0)], 2, costs(p2=0.02), False, StepPlan((0, 0))),
    ([(3, 2.5), (0, 1.0)], 2, costs(p2=0.02, v2_4=0.03), False, StepPlan((3, 0))),
    ([(3, 2.5), (2, 2.0)], 2, costs(p2=0.02, v2_4=0.05), False,
     StepPlan((0, 0), ((0, "batch_not_profitable"), (1, "batch_not_profitable")))),
    ([(0, 1.0), (2, 2.0)], 2, costs(p2=0.02), True, StepPlan((0, 0), ((1, "prompt_joining"),))),
    ([(3, 2.5)], 1, costs(), True, StepPlan((3,))),
])
def test_a_step_plan_names_the_rows_it_passes_over(
        wants: list[tuple[int, float]], batch: int, c: StepCosts, joining: bool,
        plan: StepPlan) -> None:
    got = decide_step(wants, batch, c, joining)
    assert got == plan
    assert list(got.depths) == plan_step(wants, batch, c, joining)
    assert got.width == 1 + max(got.depths) and got.verify == any(got.depths)


def test_a_probe_due_while_a_prompt_joins_comes_once_it_has_joined() -> None:
    """Plain steps taken while a prompt joined count toward the next probe."""
    c = costs(p2=0.02, v2_4=0.05)
    wants = [(3, 2.5), (2, 2.0)]
    for _ in range(probe_every(0.02, 0.05)):
        assert plan_step(wants, 2, c, joining=True) == [0, 0]
        c.observe(2, 1, None)  # a step the prompt rode: counted, not timed
    assert plan_step(wants, 2, c, joining=True) == [0, 0]
    assert plan_step(wants, 2, c) == [3, 2]  # joined: the probe that was due


@pytest.mark.parametrize(("plain", "verify", "every", "why"), [
    (0.02, 0.04, PROBE_EVERY, "a probe costing 1 plain step more: every PROBE_EVERY"),
    (0.045, 0.426, 424, "measured at 16 rows on the CPU: 381 ms beyond / 2% of 45 ms"),
    (0.01, 0.02, PROBE_EVERY, "no dearer than PROBE_EVERY asks"),
    (0.001, 10.0, 1024, "at most PROBE_CAP"),
    (0.05, 0.04, PROBE_EVERY, "a verify no dearer than a plain step"),
])
def test_probe_every(plain: float, verify: float, every: int, why: str) -> None:
    assert probe_every(plain, verify) == every, why


def test_a_dear_losing_size_is_probed_seldom() -> None:
    """A verify size far dearer than a plain step is probed after `probe_every` plain
    steps, not PROBE_EVERY."""
    c = costs(p16=0.045, v16_7=0.426)
    wants = [(6, 3.0)] * 16
    for _ in range(probe_every(0.045, 0.426) - 1):
        c.observe(16, 1, 0.045)
        assert plan_step(wants, 16, c) == [0] * 16
    c.observe(16, 1, 0.045)
    assert plan_step(wants, 16, c) == [6] * 16  # the probe


def test_a_losing_size_is_probed_again() -> None:
    c = costs(p2=0.02, v2_4=0.05)
    wants = [(3, 2.5), (2, 2.0)]
    for _ in range(probe_every(0.02, 0.05) - 1):
        c.observe(2, 1, 0.02)
        assert plan_step(wants, 2, c) == [0, 0]
    c.observe(2, 1, 0.02)
    assert plan_step(wants, 2, c) == [3, 2]  # the probe
    c.observe(2, 4, 0.05)
    assert plan_step(wants, 2, c) == [0, 0]  # and back to plain until the next one


def test_a_winning_size_measures_its_plain_step_again() -> None:
    """A plain time measured once, slow for reasons of its own, is not kept for ever: after
    PROBE_EVERY verify steps a plain step is taken, its time replaces the old one, and
    the comparison turns."""
    c = costs(p8=0.137, v8_4=0.2)
    wants = [(3, 2.0)] * 8  # 16 tokens / 200 ms: beats 8 / 137 ms, loses to 8 / 80 ms
    for _ in range(PROBE_EVERY):
        assert plan_step(wants, 8, c) == [3] * 8
        c.observe(8, 4, 0.2)
    assert plan_step(wants, 8, c) == [0] * 8  # the plain probe
    c.observe(8, 1, None)  # right after a verify step: the engine does not time it
    assert plan_step(wants, 8, c) == [0] * 8  # the figure is being measured afresh
    c.observe(8, 1, 0.08)
    assert c.time(8, 1) == pytest.approx(0.08)  # replaced, not averaged with 137 ms
    for _ in range(SETTLED - 1):
        assert plan_step(wants, 8, c) == [0] * 8
        c.observe(8, 1, 0.08)
    assert plan_step(wants, 8, c) == [0] * 8  # settled: 8 / 80 ms beats 16 / 200 ms
    assert c.verify_since_plain[8] == 0


def test_a_verify_step_is_judged_against_a_settled_plain_time() -> None:
    """Until SETTLED plain steps of a size have been timed, its steps stay plain: one
    figure alone (a first step of new rows, timed long) does not decide.  A second
    that finds the first OUTLIER times too high starts the figure again from it."""
    c = StepCosts()
    wants = [(6, 3.5)] * 16
    c.observe(12, 1, 0.16)  # measured: a first plain step at 12 rows
    assert not c.settled(16)
    assert plan_step(wants, 16, c) == [0] * 16  # not judged on one figure
    c.observe(16, 1, 0.035)
    assert c.settled(16) and c.time(16, 1) == pytest.approx(0.035)
    assert plan_step(wants, 16, c) == [6] * 16  # verify unmeasured at this size: tried
    c.observe(16, 7, 0.238)
    assert plan_step(wants, 16, c) == [0] * 16  # 56 / 238 ms loses to 16 / 35 ms


def test_step_times_are_moving_averages_by_class() -> None:
    c = StepCosts()
    c.observe(3, 1, 0.10)
    c.observe(4, 1, 0.20)  # same class as 3
    assert c.time(3, 1) == pytest.approx(0.12)
    assert c.time(2, 1) is None


@pytest.mark.parametrize(("arrived", "began", "expected", "why"), [
    (3, [], False, "nobody decodes"),
    (3, [5, 7], False, "every decoding row began after the group arrived: one cohort"),
    (8, [1], False, "a row 7 steps in has no pace yet: the group arrived with it"),
    (9, [1], True, "a row 8 steps in was decoding when the group arrived"),
    (20, [15, 1], True, "one row of the batch was that far in"),
    (20, [15, 14], False, "none was"),
    (30, [2, 5, 8], True, "a group that arrived long after all of them began"),
])
def test_paced(arrived: int, began: list[int], expected: bool, why: str) -> None:
    assert paced(arrived, began) is expected, why


@pytest.mark.parametrize(("ride", "own", "limit", "n", "want", "why"), [
    (None, 9, 100, 1, 8, "never measured: the first ride's tokens"),
    (None, 9, 100, 3, 6, "never measured, steps of 3: whole rows"),
    (29, 9, 100, 1, 29, "riding fits more than a forward of its own"),
    (29, 9, 20, 1, 20, "no further than the prompt's next cut"),
    (29, 9, 20, 4, 20, "rows of 4 up to the cut"),
    (29, 9, 18, 4, 16, "rows of 4 short of the cut"),
    (29, 9, 3, 4, 0, "one row of 4 would cross the cut: a forward of its own"),
    (5, 9, 100, 1, 0, "a forward of its own fits more: it takes that"),
    (0, 0, 100, 1, 1, "nothing fits either way: one row, the least that moves on"),
    (0, 0, 100, 5, 5, "one row of a verify step's 5"),
    (9, 9, 100, 2, 8, "a tie rides (no fixed part), in rows of 2"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_ride_tokens(ride: int | None, own: int, limit: int, n: int, want: int,
                     why: str) -> None:
    assert ride_tokens(ride, own, limit, n, 8) == want, why


def test_a_step_counted_without_its_time_still_brings_the_probe_due() -> None:
    """A step whose time was not the rows' own (a prompt rode it) leaves the measured
    times alone but still counts: a verify probe comes after `probe_every` plain steps
    of any kind, instead of every step once the probe is due but never measured."""
    c = costs(p8=0.05, v8_4=0.5)
    wants = [(3, 2.5)] * 8
    for _ in range(probe_every(0.05, 0.5)):
        c.observe(8, 1, None)
    assert c.time(8, 1) == 0.05
    assert plan_step(wants, 8, c) == [3] * 8  # the probe is due
    c.observe(8, 4, None)  # it was taken, with a prompt riding: no time, but counted
    assert c.time(8, 4) == 0.5
    assert plan_step(wants, 8, c) == [0] * 8  # plain again until the next is due


def keeps(accept: float) -> Callable[[int], float]:
    """Expected tokens of a round of depth d where each drafted token is kept with
    probability `accept` (a row's policy, as a table)."""
    return lambda d: sum(accept**i for i in range(d + 1))


@pytest.mark.parametrize(("c", "batch", "accept", "deepest", "due", "why"), [
    (costs(p8=0.01, v8_4=0.1), 1, 0.9, 6, True, "a row alone always drafts"),
    (costs(), 8, 0.5, 6, True, "nothing measured at this size"),
    (costs(p8=0.01), 8, 0.5, 6, True, "no verify width measured: one is still to be tried"),
    (costs(v8_4=0.1), 8, 0.5, 6, True, "no plain time"),
    (costs(p8=0.01, v8_4=0.1), 8, 0.9, 6, False,
     "3.4 tokens in 100 ms against 1 in 10 ms: a loss at any acceptance this row expects"),
    (costs(p8=0.01, v8_4=0.03), 8, 0.9, 6, True, "3.4 tokens in 30 ms beat 1 in 10 ms"),
    (costs(p8=0.01, v8_4=0.03), 8, 0.3, 6, False, "1.4 tokens in 30 ms lose to 3 in 30 ms"),
    (costs(p8=0.01, v8_4=0.1, v8_2=0.015), 8, 0.6, 6, True,
     "one width wins (1.6 tokens in 15 ms), so the drafter may pay"),
    (costs(p8=0.01, v8_4=0.03), 8, 0.9, 2, True,
     "a width deeper than the row drafts says nothing of it"),
    (costs(p8=0.01, v8_4=0.1, v4_4=0.02), 4, 0.9, 6, True, "another size's figures are its own"),
    (costs(p8=0.01, v8_4=0.1), 5, 0.9, 6, False, "5 rows: the class of 8"),
])
def test_drafter_due(c: StepCosts, batch: int, accept: float, deepest: int, due: bool,
                     why: str) -> None:
    assert drafter_due(c, batch, keeps(accept), deepest) is due, why


@pytest.mark.parametrize(("left", "prefill_s", "batch", "due", "why"), [
    (96, None, 8, True, "no drafter prefill measured yet"),
    (96, 0.01, 8, True, "96 tokens at 7.5 ms saved repay 8 prefills of 10 ms"),
    (96, 0.1, 8, False, "... not 8 of 100 ms (0.72 s against 0.8 s)"),
    (96, 0.1, 7, True, "7 rows of 100 ms: 0.7 s"),
    (10, 0.01, 8, False, "10 tokens left save 75 ms, against 80 ms of prefill"),
    (0, 0.0, 8, True, "nothing to take: nothing to repay"),
])
def test_drafter_due_repays_the_batchs_drafter_prefill(left: int, prefill_s: float | None,
                                                       batch: int, due: bool, why: str) -> None:
    """A width that wins (4 tokens a row in 10 ms against 1 in 10 ms: 7.5 ms a token
    saved) makes a drafter due only where the row's tokens left at that saving repay
    the batch's drafter prefills."""
    c = costs(p8=0.01, v8_4=0.01)
    assert drafter_due(c, batch, lambda d: d + 1.0, 6, left, prefill_s) is due, why


# A plain token 10 ms, a round of depth d 10 + 2d ms keeping d + 1 tokens: depth 3
# saves 10 - 16 / 4 = 6 ms a token, the best of 1..3 (4.0 at 1, 5.33 at 2).
TIMES = (0.010, 0.012, 0.014, 0.016)


@pytest.mark.parametrize(("seconds", "deepest", "left", "prefill_s", "due", "why"), [
    (None, 3, 5, 1.0, True, "no times: nothing says otherwise"),
    (TIMES, 3, 5, None, True, "no drafter prefill measured"),
    (TIMES, 3, 100, 0.5, True, "100 tokens at 6 ms saved repay 0.5 s"),
    (TIMES, 3, 5, 0.5, False, "5 tokens left save 30 ms against 0.5 s of catch-up"),
    (TIMES, 1, 100, 0.5, False, "at depth 1 at most: 4 ms a token, 0.4 s against 0.5 s"),
    (TIMES, 3, 0, 0.0, True, "nothing to take: nothing to repay"),
    ((0.010, 0.030, 0.040, 0.050), 3, 1000, 0.001, False,
     "every round loses (30 ms for 2 tokens): nothing repays"),
    ((0.010,), 3, 1000, 0.001, True, "no round times: nothing says otherwise"),
    (TIMES, 0, 5, 0.5, True, "no depth to draft: nothing says otherwise"),
    (TIMES, 15, 100, 0.5, True, "deeper than the policy holds: its depths 1..3"),
    (TIMES, 15, 5, 0.5, False, "... and 5 tokens repay nothing there either"),
])
def test_a_row_left_alone_catches_its_drafter_up_where_its_tokens_left_repay_it(
        seconds: tuple[float, ...] | None, deepest: int, left: int, prefill_s: float | None,
        due: bool, why: str) -> None:
    assert catch_up_due(seconds, lambda d: d + 1.0, deepest, left, prefill_s) is due, why


def test_drafter_due_waits_for_a_settled_plain_time() -> None:
    c = costs(p8=0.01, v8_4=0.1)
    c.timed[(8, 1)] = SETTLED - 1
    assert drafter_due(c, 8, keeps(0.9), 6)
    c.timed[(8, 1)] = SETTLED
    assert not drafter_due(c, 8, keeps(0.9), 6)


@pytest.mark.parametrize(("batch", "compiles", "expected"), [
    (1, True, True),  # a row alone: the warm-up built its shapes
    (1, False, True),
    (2, False, True),  # built ahead (the CPU): its step costs judge
    (16, False, True),
    (2, True, False),  # a batch where each shape builds on first use (CUDA)
    (16, True, False),
])
def test_speculates(batch: int, compiles: bool, expected: bool) -> None:
    assert speculates(batch, compiles) is expected


def test_a_batch_that_builds_its_shapes_steps_plain_whatever_it_measured() -> None:
    """Where each shape builds on first use, a batch steps plain even where its step
    costs say a verify step wins, names the rows it passed over, and its rows' drafters
    take no prompt; a row alone follows its wish there as ever."""
    c = costs(p8=0.05, v8_4=0.06)
    wants = [(3, 2.8)] * 8
    assert plan_step(wants, 8, c) == [3] * 8  # built ahead: 22.4 / 60 ms beats 8 / 50 ms
    assert plan_step(wants, 8, c, compiles=True) == [0] * 8
    assert decide_step(wants, 8, c, compiles=True) == StepPlan(
        (0,) * 8, tuple((b, "batch_not_profitable") for b in range(8)))
    assert plan_step([(3, 2.8)], 1, c, compiles=True) == [3]
    assert drafter_due(c, 8, keeps(0.9), 6)
    assert not drafter_due(c, 8, keeps(0.9), 6, compiles=True)
    assert drafter_due(c, 1, keeps(0.9), 6, compiles=True)

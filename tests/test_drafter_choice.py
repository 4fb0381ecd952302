"""Which drafter drafts a round (`seatd.drafter_choice`), and the cost model that prices
rounds (`seatd.spec_costs`): pure, table-tested."""

from __future__ import annotations

import pytest

from seatd.adaptive import DepthStats, RoundPolicy
from seatd.drafter_choice import (
    LOOKUP_MAX_DEPTH,
    Choice,
    choose,
    extend_times,
    lookup_policy,
    lookup_times,
    trusts,
)
from seatd.spec_costs import SPLIT_EVERY, SpecCosts

PLAIN = 0.040
VERIFY = (0.040, 0.044, 0.046, 0.060, 0.061, 0.062, 0.063)  # by width 1..7
DRAFT_STEP = 0.008


def model_times() -> tuple[float, ...]:
    """A model drafter's round at each depth: its drafting plus the verify."""
    return (PLAIN, *(DRAFT_STEP * k + VERIFY[k] for k in range(1, 7)))


def lookup_only() -> tuple[float, ...]:
    return (PLAIN, *VERIFY[1:])


def policy(times: tuple[float, ...], accept: float,
           history: tuple[tuple[int, int], ...] = ()) -> RoundPolicy:
    p = RoundPolicy(times, (accept,) * 6)
    for drafted, kept in history:
        p.observe(drafted, kept)
    return p


@pytest.mark.parametrize(("model_accept", "lookup_accept", "lookup_history", "match", "source"), [
    (0.8, 0.6, (), 0, "model"),  # no match: the lookup cannot draft
    (0.8, 0.6, ((6, 6),) * 4, 6, "lookup"),  # the request's copies were kept whole
    (0.8, 0.6, ((4, 0),) * 6, 6, "model"),  # its lookup drafts always failed
    (0.1, 0.9, (), 3, "lookup"),  # a poor model drafter, a good lookup
    (0.05, 0.05, (), 6, "model"),  # neither pays: plain (the model's depth 0)
])
def test_the_higher_expected_rate_drafts(model_accept: float, lookup_accept: float,
                                        lookup_history: tuple[tuple[int, int], ...],
                                        match: int, source: str) -> None:
    got = choose(policy(model_times(), model_accept), 6,
                 policy(lookup_only(), lookup_accept, lookup_history), match)
    assert got.source == source
    if source == "lookup":
        assert 1 <= got.depth <= match
    if model_accept == lookup_accept == 0.05:
        assert got == Choice("model", 0, 1.0)


@pytest.mark.parametrize(("key", "tried", "seat_trusted", "expected"), [
    (8, (), (), False),  # nothing judged anywhere: judge first
    (8, (8,), (), True),  # the request judged this class
    (8, (4,), (), True),  # ... or a shorter one: a copy growing past 4 tokens
    (8, (16,), (), False),  # a longer class says nothing of a shorter match
    (3, (), (16,), False),  # the seat trusts only long matches
    (16, (), (3,), True),  # the seat trusts trigrams: longer matches too
    (2, (2,), (), True),
])
def test_a_longer_match_is_trusted_wherever_a_shorter_one_is(
        key: int, tried: tuple[int, ...], seat_trusted: tuple[int, ...], expected: bool) -> None:
    policies = {k: policy(lookup_only(), 0.6) for k in (2, 3, 4, 8, 16)}
    for k in tried:
        policies[k].observe(3, 1)
    assert trusts(key, policies, frozenset(seat_trusted)) is expected


def test_a_lookup_round_never_drafts_past_its_match() -> None:
    got = choose(policy(model_times(), 0.1), 6, policy(lookup_only(), 0.99), 2)
    assert got == Choice("lookup", 2, pytest.approx(1 + 0.99 + 0.99**2))


def test_without_the_model_the_lookup_competes_with_plain() -> None:
    """While the model drafter takes the prompt, or while it is parked."""
    assert choose(None, 6, policy(lookup_only(), 0.9), 4).source == "lookup"
    assert choose(None, 6, policy(lookup_only(), 0.05), 4) == Choice("model", 0, 1.0)
    assert choose(None, 6, None, 4) == Choice("model", 0, 1.0)


def test_a_model_probe_round_still_loses_to_a_better_lookup() -> None:
    got = choose(policy(model_times(), 0.1), 6, policy(lookup_only(), 0.95), 6,
                 model_lowest=1)
    assert got.source == "lookup"
    assert choose(policy(model_times(), 0.1), 6, None, 0, model_lowest=1).depth >= 1


def test_lookup_times_from_its_own_rounds_then_the_cost_model_then_the_model() -> None:
    empty = DepthStats()
    assert lookup_times(model_times(), empty) == model_times()  # nothing better known
    estimate = [None, *(VERIFY[k] + 0.001 for k in range(1, 7))]
    got = lookup_times(model_times(), empty, estimate)
    assert got[0] == PLAIN and got[3] == pytest.approx(VERIFY[3] + 0.001)
    own = DepthStats(seconds={2: 0.030, 4: 0.050})  # two depths measured: a line
    got = lookup_times(model_times(), own, estimate)
    assert got[2] == 0.030 and got[4] == 0.050 and got[3] == pytest.approx(0.040)
    one = DepthStats(seconds={3: 0.030})  # one depth measured: it, and guesses elsewhere
    got = lookup_times(model_times(), one, estimate)
    assert got[3] == 0.030 and got[5] == pytest.approx(VERIFY[5] + 0.001)


def test_a_class_takes_its_round_times_from_the_seats_lookup_rounds_of_every_class() -> None:
    """A round's time depends on its width, not on the class of its match: a class whose
    few rounds met compiling steps (its figures several times the real ones) is priced by
    the seat's lookup rounds together, and keeps its own acceptance."""
    spiky = DepthStats(max_depth=LOOKUP_MAX_DEPTH, accept=[0.9] * LOOKUP_MAX_DEPTH,
                       seconds={1: 0.150, 2: 0.200, 3: 0.240})
    rounds = DepthStats(max_depth=LOOKUP_MAX_DEPTH,
                        seconds={k: 0.041 + 0.002 * k for k in range(1, 9)})
    got = lookup_policy(model_times(), spiky, (), rounds)
    assert got.seconds == lookup_times(model_times(), rounds)
    assert got.seconds[3] == pytest.approx(0.047) and got.prior[0] == 0.9
    assert got.best(0, 8) > 0  # priced right, the copy drafts
    alone = lookup_policy(model_times(), spiky)  # by its own figures it would not
    assert alone.seconds[3] == pytest.approx(0.240) and alone.best(0, 8) == 0


@pytest.mark.parametrize(("times", "top", "want"), [
    ((0.04, 0.05, 0.06), 4, (0.04, 0.05, 0.06, 0.07, 0.08)),  # on the last two's line
    ((0.04, 0.05, 0.06), 1, (0.04, 0.05)),  # shorter: cut
    ((0.04, 0.05, 0.06), 2, (0.04, 0.05, 0.06)),
    ((0.04, 0.07, 0.06), 3, (0.04, 0.07, 0.06, 0.06)),  # a falling last step: flat
    ((0.04, 0.05), 3, (0.04, 0.05, 0.05, 0.05)),  # one depth: flat
])
def test_round_times_past_the_models_deepest_depth(times: tuple[float, ...], top: int,
                                                   want: tuple[float, ...]) -> None:
    assert extend_times(times, top) == pytest.approx(want)


def test_a_lookup_that_keeps_whole_copies_drafts_past_the_models_deepest_depth() -> None:
    """Rounds cost their verify (a line in the width past the model's depths); where a
    request's lookup kept every token it drafted, a long match is drafted deeper than the
    model drafter ever goes; where it kept little, it stays shallow."""
    deep = DepthStats(max_depth=LOOKUP_MAX_DEPTH)
    estimate = [None, *(0.040 + 0.002 * k for k in range(1, LOOKUP_MAX_DEPTH + 1))]
    times = lookup_times(model_times(), deep, estimate)
    assert len(times) == LOOKUP_MAX_DEPTH + 1
    assert times[LOOKUP_MAX_DEPTH] == pytest.approx(0.040 + 0.002 * LOOKUP_MAX_DEPTH)
    copier = RoundPolicy(times, tuple(deep.accept))
    for _ in range(4):
        copier.observe(6, 6)
    got = choose(policy(model_times(), 0.5), 6, copier, 12)
    assert got.source == "lookup" and 6 < got.depth <= 12  # past the model, within the match
    misser = RoundPolicy(times, tuple(deep.accept))
    for _ in range(4):
        misser.observe(6, 1)
    got = choose(policy(model_times(), 0.1), 6, misser, 12)
    assert got.depth <= 6


def test_an_estimate_above_the_models_round_is_not_believed() -> None:
    high = [None, *(1.0,) * 6]
    assert lookup_times(model_times(), DepthStats(), high) == model_times()


def test_cost_model_terms_and_prediction() -> None:
    c = SpecCosts()
    assert c.round(3) is None
    c.observe_plain(PLAIN)
    c.observe_round(2, 2 * DRAFT_STEP, VERIFY[2], 2 * DRAFT_STEP + VERIFY[2] + 0.002)
    c.observe_round(4, 4 * DRAFT_STEP, VERIFY[4], 4 * DRAFT_STEP + VERIFY[4] + 0.002)
    assert c.drafter_step() == pytest.approx(DRAFT_STEP)
    assert c.host == pytest.approx(0.002)
    assert c.verify(4) == pytest.approx((VERIFY[2] + VERIFY[4]) / 2)  # on the line
    assert c.round(3) == pytest.approx(3 * DRAFT_STEP + c.verify(4) + 0.002)  # type: ignore[operator]
    assert c.round(0) == PLAIN
    # A lookup round pays no drafting; before its own host time, the model's stands in.
    assert c.round(4, lookup=True) == pytest.approx(VERIFY[4] + 0.002)
    c.observe_round(3, 0.0005, VERIFY[3], 0.0005 + VERIFY[3] + 0.0005, lookup=True)
    assert c.lookup_host == pytest.approx(0.001)
    assert c.drafter_step() == pytest.approx(DRAFT_STEP)  # a lookup round drafts nothing
    snap = c.snapshot()
    assert snap["plain"] == 40000 and snap["drafter_step"] == 8000 and "verify_w5" in snap


def test_one_round_in_every_few_is_split() -> None:
    c = SpecCosts()
    due = [c.due() for _ in range(3 * SPLIT_EVERY)]
    assert due.count(True) == 3 and due[0]

"""Adaptive draft depth: expected tokens, warm-up, choice by rate, parking at 0, and the
per-round policy inside a request."""

import pytest

from seatd.adaptive import (
    MAX_DEPTH,
    WARM_AGAIN,
    WARM_ORDER,
    DepthStats,
    RoundPolicy,
    choose_depth,
    expected_tokens,
    observe,
    park_tokens,
    round_times,
    seed_times,
)


def warmed(accept: float, round_s: dict[int, float]) -> DepthStats:
    s = DepthStats(max_depth=6, accept=[accept] * 6)
    for k in range(7):
        s.seen[k] = 1
        s.seconds[k] = round_s[k]
    s.requests = 1
    return s


@pytest.mark.parametrize(("parks", "tokens"), [(-1, 8), (0, 8), (1, 16), (2, 32), (3, 64),
                                               (4, 64), (50, 64)])
def test_parked_bursts_double_while_probes_fail(parks: int, tokens: int) -> None:
    """A parked request's plain burst doubles after each probe that did not bring it back
    to drafting, up to 8x the first."""
    assert park_tokens(parks) == tokens


def test_expected_tokens() -> None:
    """E(k) = 1 + a + a^2 + ... + a^k for a constant acceptance a."""
    s = DepthStats(accept=[0.5] * 6)
    assert s.expected_tokens(0) == 1.0
    assert s.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens([0.5] * 6, 2) == 1.75  # the cost model's, from a list
    assert expected_tokens([0.5, 0.0, 0.9], 3) == 1.5  # nothing past a sure miss


def test_warm_up_visits_every_depth_once() -> None:
    """Before rates exist, successive requests try each depth once, in a fixed order."""
    s = DepthStats()
    seen = []
    for _ in range(7):
        k = choose_depth(s)
        seen.append(k)
        observe(s, k, 0, 0.01)
    assert tuple(seen) == WARM_ORDER


def test_requests_arriving_together_warm_different_depths() -> None:
    """Requests that choose before any of them ran a round each take a warm depth of
    their own; past the warm order, the first warm depth (nothing is measured yet).  A
    depth handed out but not seen in the WARM_AGAIN rounds after goes out again."""
    s = DepthStats()
    picks = [choose_depth(s) for _ in range(16)]
    assert tuple(picks[: len(WARM_ORDER)]) == WARM_ORDER
    assert picks[len(WARM_ORDER):] == [WARM_ORDER[0]] * (16 - len(WARM_ORDER))
    for k in WARM_ORDER:
        if k != 4:
            observe(s, k, 0, 0.01 + 0.002 * k)
    assert choose_depth(s) != 4  # its request may still be warming it
    for _ in range(WARM_AGAIN - s.rounds):
        observe(s, 3, 0, 0.016)
    assert choose_depth(s) == 4  # its request ended before a round of it: again
    assert choose_depth(s) != 4


def test_picks_the_depth_with_best_rate() -> None:
    """High acceptance and cheap verification favour a deep draft."""
    cost = {k: 0.020 + 0.002 * k for k in range(7)}  # verify ~ one step, drafts cheap
    s = warmed(0.9, cost)
    assert choose_depth(s) == 6


def test_parks_at_zero_when_speculation_loses() -> None:
    """Low acceptance and costly rounds: plain decoding (depth 0) wins."""
    cost = {0: 0.020, **{k: 0.030 + 0.010 * k for k in range(1, 7)}}
    s = warmed(0.1, cost)
    assert choose_depth(s) == 0


def test_probes_a_neighbour_now_and_then() -> None:
    """Every few requests a neighbouring depth is tried, so a parked seat can come back."""
    cost = {0: 0.020, **{k: 0.030 + 0.010 * k for k in range(1, 7)}}
    s = warmed(0.1, cost)
    picks = [choose_depth(s) for _ in range(16)]
    assert 0 in picks and 1 in picks


def test_observe_updates_acceptance_per_position() -> None:
    """Kept positions count as hits, the first rejected as a miss, later ones untouched."""
    s = DepthStats(accept=[0.5] * 6)
    observe(s, 4, 2, 0.01)
    assert s.accept[0] > 0.5 and s.accept[1] > 0.5
    assert s.accept[2] < 0.5
    assert s.accept[3] == 0.5


def test_a_depth_far_above_its_neighbours_line_takes_the_line() -> None:
    """Figures of a lookup's rounds on an H200, one depth of them carrying a round that
    built a shape (45 ms among 4-10 ms): the line through the others, not the spike and
    not a line it tilted, prices that depth; the depths on the line keep their own."""
    s = DepthStats(max_depth=15, seconds={0: 0.0027, 3: 0.0040, 4: 0.0454, 5: 0.0049,
                                          14: 0.0097})
    times = round_times(s)
    assert times is not None
    assert times[3] == 0.0040 and times[5] == 0.0049 and times[14] == 0.0097
    assert 0.0040 < times[4] < 0.0049  # between its neighbours, not 45 ms
    assert times[1] < times[3] and times[15] > times[14]  # the line, rising
    # two depths measured, one of them a spike: the plain token's figure says which
    two = round_times(DepthStats(max_depth=15, seconds={0: 0.0039, 1: 0.0676, 3: 0.0044}))
    assert two is not None and two[3] == 0.0044 and two[1] < 0.0044 and two[15] < 0.0100
    # a dearer depth within SPIKE of the line is believed: rounds may cost more than linear
    s.seconds[4] = 0.0080
    times = round_times(s)
    assert times is not None and times[4] == 0.0080


def test_round_times_fill_unmeasured_depths_on_a_line() -> None:
    s = DepthStats(seconds={0: 0.02, 1: 0.03, 3: 0.05})
    times = round_times(s)
    assert times is not None and len(times) == MAX_DEPTH + 1
    assert times[0] == 0.02 and times[1] == 0.03 and times[3] == 0.05
    assert abs(times[2] - 0.04) < 1e-12 and abs(times[6] - 0.08) < 1e-12
    assert round_times(DepthStats(seconds={1: 0.03, 3: 0.05})) is None  # no plain time
    assert round_times(DepthStats(seconds={0: 0.02, 3: 0.05})) is None  # one depth


CHEAP = tuple([0.020] + [0.022 + 0.002 * k for k in range(1, 7)])  # verify ~ a step


@pytest.mark.parametrize(("prior", "history", "expected"), [
    (0.9, [], 6),  # a good prior and cheap rounds: deep
    (0.6, [(6, 6)] * 10, 6),  # the request keeps everything
    (0.6, [(3, 0)] * 10, 0),  # the request's drafts always fail: park
    (0.1, [], 0),  # a bad prior parks before trying
    # the request's own acceptance outweighs the prior, as far as it borrows: it kept
    # positions 1-2, so it hopes as much of 3-4 and no further (`borrows`)
    (0.1, [(2, 2)] * 20, 4),
])
def test_round_policy_follows_the_requests_own_acceptance(prior: float, history: list,
                                                          expected: int) -> None:
    p = RoundPolicy(CHEAP, (prior,) * 6)
    for drafted, kept in history:
        p.observe(drafted, kept)
    assert p.best() == expected


def test_round_policy_borrows_no_further_than_twice_its_reach() -> None:
    p = RoundPolicy((0.002,) * 16, (0.1,) * 15)
    assert not any(p.borrows(i) for i in range(15))  # nothing tried: the prior
    p.observe(3, 3)  # kept all three of a depth-3 round
    assert [i for i in range(15) if p.borrows(i)] == [3, 4, 5]
    assert p.accept(5) == p.accept(2) > p.accept(6) == 0.1
    expected = p.expected_upto(8)
    assert expected[6] - expected[5] == pytest.approx(p.accept(2) ** 6)
    assert expected[7] - expected[6] == pytest.approx(p.accept(2) ** 6 * 0.1)
    p.observe(6, 6)
    assert [i for i in range(15) if p.borrows(i)] == [6, 7, 8, 9, 10, 11]
    p.observe(12, 12)
    assert [i for i in range(15) if p.borrows(i)] == [12, 13, 14]
    p.observe(15, 2)  # a miss at position 3 is a figure of its own, no hope
    assert not p.borrows(2) and p.accept(2) < p.accept(1)


def test_round_policy_probes_a_positive_depth_while_parked() -> None:
    p = RoundPolicy(CHEAP, (0.1,) * 6)
    assert p.best() == 0 and p.best(lowest=1) >= 1


def test_round_policy_counts_only_positions_it_reached() -> None:
    p = RoundPolicy(CHEAP, (0.5,) * 6)
    p.observe(4, 1)
    assert p.tries == [1, 1, 0, 0, 0, 0] and p.hits == [1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("history", [(), ((3, 3),), ((2, 0), (5, 5)), ((1, 1), (4, 2), (6, 6))])
def test_expected_tokens_at_every_depth_in_one_pass_equal_each_depths_own(
        history: tuple[tuple[int, int], ...]) -> None:
    """The one-pass figures (untried positions borrowing the nearest tried one before
    them) are exactly the product formula over `accept`, depth by depth."""
    p = RoundPolicy(tuple(0.04 + 0.01 * k for k in range(10)), (0.7, 0.5, 0.9, 0.3, 0.6,
                                                               0.8, 0.2, 0.4, 0.55))
    for drafted, kept in history:
        p.observe(drafted, kept)
    got = p.expected_upto(9)
    for k in range(10):
        total, run = 1.0, 1.0
        for i in range(k):
            run *= p.accept(i)
            total += run
        assert got[k] == total
    assert p.best(0, 4) <= 4 and p.best(2) >= 2


@pytest.mark.parametrize(("parks", "seconds", "tokens"), [
    (0, None, 8),                                  # no times: the doubling alone
    (0, (0.022, 0.035, 0.047), 30),                # CPU-like: a round 13 ms over a token
    (0, (0.0014, 0.003, 0.004), 58),               # GPU, cheap rounds: 1.6 ms over 1.4
    (0, (0.0014, 0.02, 0.03), 665),                # GPU, 20 ms rounds: probe very seldom
    (3, (0.0014, 0.0015, 0.004), 64),              # the doubling, where it is longer
    (0, (0.0014, 1.0, 2.0), 1024),                 # never past PARK_CAP
    (0, (0.01, 0.008, 0.02), 8),                   # a round cheaper than a token: no floor
    (0, (0.0, 0.01), 8),                           # no plain time measured: the doubling
])
def test_parked_bursts_pay_for_their_probes(parks: int, seconds: tuple[float, ...] | None,
                                            tokens: int) -> None:
    """A burst is long enough that a failed probe (the cheapest round, less the plain token
    it yields) costs at most PROBE_SHARE of the burst: measured times, not a count."""
    assert park_tokens(parks, seconds) == tokens


@pytest.mark.parametrize("rounds", [
    [], [(3, 3)], [(3, 1)], [(6, 6), (2, 0)], [(15, 2), (3, 3)], [(1, 1)] * 4 + [(5, 5)],
])
def test_expected_tokens_in_one_pass_agree_with_each_positions_acceptance(
        rounds: list[tuple[int, int]]) -> None:
    p = RoundPolicy((0.002,) * 16, tuple(0.3 + 0.04 * i for i in range(15)))
    for drafted, kept in rounds:
        p.observe(drafted, kept)
    run, total = 1.0, [1.0]
    for i in range(15):
        run *= p.accept(i)
        total.append(total[-1] + run)
    assert p.expected_upto(15) == pytest.approx(total)


@pytest.mark.parametrize(("timed", "given", "seconds", "counts"), [
    # a fresh seat takes every measured depth, each as one observation
    ({}, {0: 0.002, 1: 0.005, 3: 0.007}, {0: 0.002, 1: 0.005, 3: 0.007}, {0: 1, 1: 1, 3: 1}),
    # a depth the seat has timed itself keeps its own figure
    ({0: (0.003, 4)}, {0: 0.002, 2: 0.006}, {0: 0.003, 2: 0.006}, {0: 4, 2: 1}),
    # past the seat's deepest, a zero or a negative figure, a negative depth: ignored
    ({}, {7: 0.01, 1: 0.0, 2: -1.0, -1: 0.001}, {}, {}),
])
def test_measured_round_times_seed_only_the_depths_the_seat_has_not_timed(
        timed: dict[int, tuple[float, int]], given: dict[int, float],
        seconds: dict[int, float], counts: dict[int, int]) -> None:
    s = DepthStats(max_depth=6)
    for k, (t, n) in timed.items():
        s.seconds[k], s.timed[k] = t, n
    accept = list(s.accept)
    seed_times(s, given)
    assert s.seconds == seconds and s.timed == counts
    assert s.accept == accept and s.seen == {}  # acceptance and the warm order untouched


def test_a_seat_seeded_with_dear_rounds_parks_its_first_request() -> None:
    """Rounds measured at three plain tokens' cost: the first request's policy (there is
    one from the start) takes plain tokens at the prior acceptance; cheap rounds draft."""
    dear, cheap = DepthStats(), DepthStats()
    seed_times(dear, {0: 0.0025, 1: 0.0055, 2: 0.0065, 3: 0.0075})
    seed_times(cheap, {0: 0.0025, 1: 0.0027, 2: 0.0029, 3: 0.0031})
    assert RoundPolicy.from_stats(DepthStats()) is None  # unseeded: warm depths pinned
    dear_policy, cheap_policy = RoundPolicy.from_stats(dear), RoundPolicy.from_stats(cheap)
    assert dear_policy is not None and cheap_policy is not None
    assert dear_policy.best() == 0
    assert cheap_policy.best() > 0


def test_a_policys_expected_tokens_follow_each_round_it_observes() -> None:
    """Asked every step of a batch, a policy answers from its figures since its last
    round; a round observed changes them, and a caller's copy changes nothing."""
    policy = RoundPolicy((0.01,) * 4, (0.5, 0.5, 0.5))
    before = policy.expected_upto(3)
    before[3] = 99.0  # the caller's own list
    assert policy.expected_upto(3)[3] == pytest.approx(1.875)
    policy.observe(3, 3)  # every draft kept
    after = policy.expected_upto(3)
    assert after[3] > 1.875 and after == policy.expected_upto(3)
    policy.observe(3, 0)  # the first draft rejected
    assert policy.expected(1) < after[1]


@pytest.mark.parametrize(("mine", "theirs", "want"), [
    ((), (), 1.0),  # nothing of its own yet, nor the other's: the seat's figures
    ((3.0, 3.0), (), 1.0),  # two rounds: not yet
    ((3.0, 3.0, 3.0), (), 3.0),  # its own rounds
    ((1.0, 40.0, 1.0), (), 1.0),  # one round that built a shape does not move it
    ((2.0, 4.0, 3.0, 5.0), (), 3.5),
    ((2.0, 2.0, 2.0), (0.5, 0.5, 0.5), 2.0),  # its own outweigh the other's
    ((), (0.5, 0.5, 0.5), 0.5),  # the other's cheaper rounds: tried on them
    ((2.0,), (4.0, 4.0, 4.0), 1.0),  # ... never its dearer ones
])
def test_own_scale(mine: tuple[float, ...], theirs: tuple[float, ...], want: float) -> None:
    from seatd.adaptive import own_scale

    assert own_scale(mine, theirs) == pytest.approx(want)


BASE = (0.002, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.0055)  # plain token, depths 1-6


def test_own_times_scale_rounds_and_the_plain_token_apart() -> None:
    from seatd.adaptive import own_times

    assert own_times(BASE, 1.0, 1.0) == pytest.approx(BASE)
    assert own_times(BASE, 3.0, 0.5) == pytest.approx((0.001, *(3 * t for t in BASE[1:])))


def test_a_request_whose_rounds_cost_more_than_its_seat_said_parks_on_its_own_times() -> None:
    """The seat's figures make a deep round pay (a good drafter, rounds 1.5-2.75x a plain
    token); the request's own model rounds take 6x their figure (host work per round the
    figures missed, as on a GPU whose forward is short): after OWN_TIMES of them it
    parks, for a burst long enough that its probes cost little.  A lookup policy of the
    same request keeps its own figures (the model's dear rounds say nothing of its),
    and takes the model's cheaper ones; plain tokens move only the plain figure."""
    from seatd.adaptive import LOOKUP, MODEL, OWN_TIMES, OWN_WINDOW, PLAIN

    p = RoundPolicy(BASE, (0.8,) * 6)
    lookup = RoundPolicy(BASE, (0.8,) * 6, drafter=LOOKUP, own=p.own)  # one request's
    assert p.best() > 0
    for _ in range(OWN_TIMES):
        assert p.best() > 0
        ratio = p.ratio(6, 6 * BASE[6])
        assert ratio == pytest.approx(6)
        p.own.observe(MODEL, ratio)
        p.observe(6, 4)
    assert p.best() == 0
    assert p.seconds[1:] == pytest.approx(tuple(6 * t for t in BASE[1:]))
    assert park_tokens(0, p.seconds) > park_tokens(0, BASE)
    assert lookup.seconds == pytest.approx(BASE)
    for _ in range(OWN_WINDOW):  # the device got faster again: the latest rounds decide
        p.own.observe(MODEL, p.ratio(3, BASE[3] / 2) or 0.0)
    assert p.seconds[1:] == pytest.approx(tuple(t / 2 for t in BASE[1:])) and p.best() > 0
    assert lookup.seconds[1:] == pytest.approx(tuple(t / 2 for t in BASE[1:]))
    for _ in range(OWN_TIMES):  # plain tokens move only the plain figure, of both
        p.own.observe(PLAIN, p.ratio(0, 2 * BASE[0]) or 0.0)
    assert p.seconds[0] == lookup.seconds[0] == pytest.approx(2 * BASE[0])
    assert p.seconds[1:] == pytest.approx(tuple(t / 2 for t in BASE[1:]))
    assert p.base == BASE  # the seat's figures as the request began
    # no time, or a depth it has no figure of, is no observation
    assert p.ratio(0, 0.0) is None and p.ratio(9, 1.0) is None

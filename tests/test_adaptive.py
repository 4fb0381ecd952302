"""Adaptive draft depth: expected tokens, warm-up, choice by rate, parking at 0."""

from seatd.adaptive import WARM_ORDER, DepthStats, choose_depth, observe


def warmed(accept: float, round_s: dict[int, float]) -> DepthStats:
    s = DepthStats(max_depth=6, accept=[accept] * 6)
    for k in range(7):
        s.seen[k] = 1
        s.seconds[k] = round_s[k]
    s.requests = 1
    return s


def test_expected_tokens() -> None:
    """E(k) = 1 + a + a^2 + ... + a^k for a constant acceptance a."""
    s = DepthStats(accept=[0.5] * 6)
    assert s.expected_tokens(0) == 1.0
    assert s.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125


def test_warm_up_visits_every_depth_once() -> None:
    """Before rates exist, successive requests try each depth once, in a fixed order."""
    s = DepthStats()
    seen = []
    for _ in range(7):
        k = choose_depth(s)
        seen.append(k)
        observe(s, k, 0, 0.01)
    assert tuple(seen) == WARM_ORDER


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

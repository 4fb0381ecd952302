"""Benchmark statistics: quantiles, spreads, per-pair ratios, the interleaving check."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from sanctum.bench.results import Sample
from sanctum.bench.runner import run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.stats import (
    NotInterleaved,
    check_interleaved,
    figure_values,
    geometric_mean,
    load_range,
    median,
    pair_ratios,
    quantile,
    summarize,
)


def fake_run(values: dict[str, list[float]], figure: str = "decode_tps", rounds: int = 4,
             warmup: int = 1, seed: int = 0) -> list[Sample]:
    """Run a real schedule with fake arms that return the given values in turn."""
    slots = make_schedule(list(values), ["w"], rounds, warmup, seed)
    its = {a: iter(v) for a, v in values.items()}
    clock = itertools.count(0.0, 1.0)
    arms = {a: (lambda w, a=a: {figure: next(its[a])}) for a in values}
    return run_schedule(slots, arms, run_id="r1", clock=lambda: next(clock), loadavg=lambda: 1.5)


@pytest.mark.parametrize(("xs", "q", "expected"), [
    ([1.0], 0.5, 1.0),
    ([1.0, 2.0], 0.5, 1.5),
    ([3.0, 1.0, 2.0], 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 0.25, 1.75),
    ([1.0, 2.0, 3.0, 4.0], 0.75, 3.25),
    ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
    ([float(i) for i in range(1, 101)], 0.99, 99.01),
])
def test_quantile_matches_linear_interpolation(xs: list[float], q: float,
                                               expected: float) -> None:
    """Quantiles interpolate linearly between order statistics (numpy's default)."""
    assert quantile(xs, q) == pytest.approx(expected)


def test_quantile_refuses_empty_and_out_of_range() -> None:
    """No values, or q outside [0, 1], is an error rather than a made-up number."""
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


@pytest.mark.parametrize(("xs", "wide"), [
    ([100.0, 101.0, 99.0, 100.0, 102.0], False),
    ([100.0, 150.0, 60.0, 100.0, 130.0], True),
    ([5.0], False),
])
def test_summary_flags_a_wide_spread(xs: list[float], wide: bool) -> None:
    """The IQR relative to the median decides the wide-spread warning."""
    s = summarize(xs)
    assert s.median == median(xs)
    assert s.iqr == pytest.approx(quantile(xs, 0.75) - quantile(xs, 0.25))
    assert s.wide is wide


def test_pair_ratios_pair_adjacent_samples_and_skip_warmup() -> None:
    """Each measured round gives one ratio from its own pair; warm-up gives none."""
    # Round 0 is warm-up: its outlier pair (1 vs 100) must not appear.
    samples = fake_run({"A": [1.0, 10.0, 20.0, 40.0], "B": [100.0, 20.0, 20.0, 20.0]})
    ratios = sorted(pair_ratios(samples, "decode_tps", arm="A", baseline="B"))
    assert ratios == pytest.approx([0.5, 1.0, 2.0])


def test_ratios_of_times_are_inverted_so_above_one_means_faster() -> None:
    """For seconds, arm A at half B's time is a 2x speed ratio."""
    samples = fake_run({"A": [1.0, 1.0, 1.0], "B": [2.0, 2.0, 2.0]}, figure="e2e_s", rounds=3)
    assert pair_ratios(samples, "e2e_s", "A", "B") == pytest.approx([2.0, 2.0])


def test_pair_ratios_cancel_a_slow_minute() -> None:
    """A load spike that slows both arms of one pair leaves that pair's ratio intact."""
    samples = fake_run({"A": [0, 20.0, 2.0, 20.0, 20.0], "B": [0, 10.0, 1.0, 10.0, 10.0]},
                       rounds=5)
    assert pair_ratios(samples, "decode_tps", "A", "B") == pytest.approx([2.0] * 4)


def test_errored_samples_are_left_out() -> None:
    """A sample whose arm raised counts for nothing, and its pair gives no ratio."""
    slots = make_schedule(["A", "B"], ["w"], 3, 1, seed=0)
    calls = itertools.count()

    def flaky(w: str) -> dict[str, float]:
        if next(calls) == 1:
            raise RuntimeError("boom")
        return {"decode_tps": 10.0}

    clock = itertools.count(0.0)
    samples = run_schedule(slots, {"A": flaky, "B": lambda w: {"decode_tps": 5.0}},
                           run_id="r", clock=lambda: next(clock), loadavg=lambda: 0.0)
    assert [s.error for s in samples if s.error] == ["RuntimeError: boom"]
    assert len(pair_ratios(samples, "decode_tps", "A", "B")) == 1
    assert figure_values(samples, "decode_tps", "A") == [10.0]


def test_runner_records_load_average_and_order() -> None:
    """The runner follows the schedule and records load before and after each slot."""
    loads = iter(float(i) for i in range(100))
    order: list[str] = []
    slots = make_schedule(["A", "B"], ["w1", "w2"], 2, 1, seed=4)
    clock = itertools.count(0.0)
    samples = run_schedule(slots, {a: (lambda w, a=a: order.append(a) or {}) for a in "AB"},
                           run_id="r", clock=lambda: next(clock), loadavg=lambda: next(loads))
    assert order == [s.arm for s in slots]
    assert [(s.load_before, s.load_after) for s in samples[:2]] == [(0.0, 1.0), (2.0, 3.0)]
    assert load_range(samples) == (8.0, 15.0)  # measured slots only: 4 warm-up slots first


def test_interleaved_run_passes_the_check() -> None:
    check_interleaved(fake_run({"A": [1.0] * 4, "B": [1.0] * 4}))


def _sequential(a_samples: list[Sample], b_samples: list[Sample]) -> list[Sample]:
    """All of A, then all of B: what a naive benchmark does."""
    return a_samples + b_samples


def test_sequential_arms_are_refused() -> None:
    """Two arms run one after the other (all A, then all B) are not compared."""
    a = [Sample("r", i, i, "w", "A", False, i, i + 0.5, 0, 0, {"decode_tps": 1.0})
         for i in range(4)]
    b = [Sample("r", 4 + i, i, "w", "B", False, 4 + i, 4.5 + i, 0, 0, {"decode_tps": 1.0})
         for i in range(4)]
    with pytest.raises(NotInterleaved, match="back to back"):
        pair_ratios(_sequential(a, b), "decode_tps", "A", "B")


def test_arms_from_two_runs_are_refused() -> None:
    """Samples of different run ids are two runs, however they are ordered."""
    samples = fake_run({"A": [1.0] * 4, "B": [1.0] * 4})
    other = [msgspec.structs.replace(s, run_id="r2") if s.arm == "B" else s for s in samples]
    with pytest.raises(NotInterleaved, match="runs"):
        check_interleaved(other)


def test_overlapping_slots_and_repeated_arms_are_refused() -> None:
    """Slots that overlap in time, or an arm twice in one group, break the schedule."""
    samples = fake_run({"A": [1.0] * 4, "B": [1.0] * 4})
    overlap = [msgspec.structs.replace(samples[1], started=samples[0].started), *samples[2:]]
    with pytest.raises(NotInterleaved, match="overlap"):
        check_interleaved([samples[0], *overlap])
    twice = [msgspec.structs.replace(s, arm="A") if s.seq == 1 else s for s in samples]
    with pytest.raises(NotInterleaved):
        check_interleaved(twice)


def test_one_arm_is_not_a_comparison() -> None:
    samples = [s for s in fake_run({"A": [1.0] * 4, "B": [1.0] * 4}) if s.arm == "A"]
    with pytest.raises(NotInterleaved):
        check_interleaved(samples)


def test_geometric_mean() -> None:
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        geometric_mean([0.0, 1.0])

"""The benchmark schedule: interleaved, randomised start, warm-up rounds marked."""

from __future__ import annotations

import itertools

import pytest

from sanctum.bench.schedule import arm_order, make_schedule


def test_two_arms_alternate_across_the_whole_run() -> None:
    """A B A B ...: no arm ever runs twice in a row with two arms."""
    slots = make_schedule(["A", "B"], ["w1", "w2"], rounds=4, warmup=1, seed=3)
    arms = [s.arm for s in slots]
    assert all(a != b for a, b in itertools.pairwise(arms))
    assert len(slots) == 4 * 2 * 2


@pytest.mark.parametrize("seed", range(6))
def test_every_group_runs_each_arm_once_back_to_back(seed: int) -> None:
    """Each (round, workload) group holds each arm once, in consecutive slots."""
    slots = make_schedule(["A", "B", "C"], ["w1", "w2"], rounds=3, warmup=1, seed=seed)
    groups: dict[tuple[int, str], list[int]] = {}
    for s in slots:
        groups.setdefault((s.round, s.workload), []).append(s.seq)
    for (rnd, wl), seqs in groups.items():
        arms = sorted(slots[q].arm for q in seqs)
        assert arms == ["A", "B", "C"], (rnd, wl)
        assert seqs == list(range(seqs[0], seqs[0] + 3))


def test_the_seed_decides_who_starts() -> None:
    """Over seeds, both arms get to start; the same seed gives the same schedule."""
    starts = {make_schedule(["A", "B"], ["w"], 2, 1, seed=s)[0].arm for s in range(20)}
    assert starts == {"A", "B"}
    assert make_schedule(["A", "B"], ["w"], 3, 1, seed=7) == make_schedule(
        ["A", "B"], ["w"], 3, 1, seed=7)
    assert sorted(arm_order(["A", "B", "C"], 5)) == ["A", "B", "C"]


@pytest.mark.parametrize(("rounds", "warmup", "expected_warm"), [(3, 1, 2), (5, 2, 4), (2, 0, 0)])
def test_warmup_rounds_come_first_and_are_marked(rounds: int, warmup: int,
                                                 expected_warm: int) -> None:
    """The first `warmup` rounds, and only they, are marked warm-up."""
    slots = make_schedule(["A", "B"], ["w"], rounds, warmup, seed=1)
    flags = [s.warmup for s in slots]
    assert flags == [True] * expected_warm + [False] * (len(slots) - expected_warm)
    assert all(s.warmup == (s.round < warmup) for s in slots)


@pytest.mark.parametrize(("arms", "workloads", "rounds", "warmup"), [
    (["A"], ["w"], 3, 1),            # one arm compares nothing
    (["A", "A"], ["w"], 3, 1),       # duplicate arm
    (["A", "B"], [], 3, 1),          # no workload
    (["A", "B"], ["w", "w"], 3, 1),  # duplicate workload
    (["A", "B"], ["w"], 1, 1),       # nothing left after warm-up
    (["A", "B"], ["w"], 3, -1),      # negative warm-up
])
def test_bad_schedules_are_refused(arms: list[str], workloads: list[str], rounds: int,
                                   warmup: int) -> None:
    """Schedules that could not give an interleaved comparison are refused up front."""
    with pytest.raises(ValueError):
        make_schedule(arms, workloads, rounds, warmup)

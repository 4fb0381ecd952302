"""A seat's moving averages of its own times: one compiling round cannot carry them."""

import pytest

from seatd import adaptive
from seatd.adaptive import DepthStats, observe
from seatd.moving_average import FLOOR_S, OUTLIER, moving
from seatd.spec_costs import SpecCosts

A = 0.2


@pytest.mark.parametrize(("old", "value", "seen", "want"), [
    (None, 1.4, 0, 1.4),  # the first observation is the figure
    (1.4, 0.003, 1, 0.003),  # the first was a compiling round: start from the second
    (0.003, 1.4, 1, 0.8 * 0.003 + A * OUTLIER * 0.003),  # a compiling round later: capped
    (0.010, 0.001, 5, 0.8 * 0.010 + A * 0.001),  # an average is not dropped for one short step
    (0.010, 0.020, 5, 0.8 * 0.010 + A * 0.020),  # within bounds: the plain average
    (0.0, 0.001, 3, A * OUTLIER * FLOOR_S),  # a figure near zero caps at its floor
    (0.010, 0.005, 1, 0.8 * 0.010 + A * 0.005),  # twice as fast is no outlier
])
def test_moving_figures(old: float | None, value: float, seen: int, want: float) -> None:
    assert moving(old, value, A, seen) == pytest.approx(want)


def test_a_doubling_is_followed_within_a_few_observations() -> None:
    figure = 0.003
    for _ in range(12):
        figure = moving(figure, 0.006, A, 9)
    assert figure == pytest.approx(0.006, rel=0.1)


def test_the_cost_model_forgets_a_first_round_that_compiled() -> None:
    costs = SpecCosts()
    costs.observe_round(3, 0.002, 1.4, 1.4025)  # a new verify width: kernels compile
    costs.observe_round(3, 0.002, 0.003, 0.0055)
    verify = costs.verify(4)
    assert verify is not None and verify == pytest.approx(0.003)
    # the round: its draft, the second verify alone, and host time (the rest of each)
    assert costs.round(3) == pytest.approx(0.002 + 0.003 + 0.0005)
    costs.observe_plain(0.9)
    costs.observe_plain(0.0015)
    assert costs.plain == pytest.approx(0.0015)


def test_a_depths_round_time_forgets_its_compiling_first_round() -> None:
    stats = DepthStats()
    observe(stats, 2, 1, 0.9)
    observe(stats, 2, 2, 0.004)
    assert stats.seconds[2] == pytest.approx(0.004)
    observe(stats, 2, 2, 0.9)  # later: capped at OUTLIER times the figure, not taken whole
    assert stats.seconds[2] == pytest.approx(
        (1 - adaptive.ALPHA) * 0.004 + adaptive.ALPHA * OUTLIER * 0.004)

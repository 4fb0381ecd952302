"""The moving averages a seat keeps of its own times, safe from one outlier.

On a GPU the first step of a new shape compiles: MLX's CUDA backend JIT-compiles kernels
and instantiates CUDA graphs for it.  Measured on an H200 with the demo pair, a verify
round of a width seen for the first time took 17 ms to 1.4 s against 3 ms after, and a
plain average carried such a figure for dozens of rounds (0.8**28 of 1.4 s is still
3 ms).  So one observation moves a figure by at most OUTLIER times it, and a figure of
one observation that the second finds OUTLIER times too high (the first was a compiling
round) starts again from the second.  Only the first may be dropped so: later figures
are averages, and a short step among them (a plain step that found nothing in flight to
wait for) is no reason to forget them.  Real changes still come through: a figure that
doubles is followed within a few observations.

    moving(old, value, alpha, seen) -> float   seen: observations in old (old None: none)
"""

from __future__ import annotations

OUTLIER = 4.0  # an observation counts for at most this many times the figure
FLOOR_S = 50e-6  # ... of at least this (a figure near zero is no yardstick)


def moving(old: float | None, value: float, alpha: float, seen: int = 2) -> float:
    """The figure after one more observation `value` (seconds).  Pure."""
    if old is None:
        return value
    if seen == 1 and value * OUTLIER < old:
        return value
    value = min(value, OUTLIER * max(old, FLOOR_S))
    return (1 - alpha) * old + alpha * value

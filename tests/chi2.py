"""Pearson's chi-square for the distribution gates, with its critical values."""

from __future__ import annotations

import math

import numpy as np

Z_999 = 3.090  # one-sided normal quantile for alpha = 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray, trials: int) -> tuple[float, int]:
    """Pearson's statistic over bins expecting >= 5, the rest pooled in one bin."""
    expected = probs * trials
    big = expected >= 5
    obs = [*counts[big], counts[~big].sum()]
    exp = [*expected[big], expected[~big].sum()]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return float(stat), len(obs) - 1

"""The keyed sampler's distribution gate on the demo target's real logits.

Over many seeds, the token a seeded request gets at one answer position follows the
filtered target distribution p, and two consecutive positions follow p(x) p(y | x)
(chi-square at alpha 0.001, critical values printed).  Two sabotaged rules must fail
it: noise that ignores the seed (every seed gets the same answer), and one noise
reused at consecutive positions, whose marginals are right, so that only the joint
test can see it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from seatd.engine_types import make_cache, output_width
from seatd.model_load import load_for_compute
from seatd.sampling import Keyed, filter_logits
from shared.protocol import SamplingParams
from tests.chi2 import chi2_critical, chi_square
from tests.spec_models import snippet, target_dir

pytestmark = pytest.mark.slow

SEEDS = 8_000
BATCH = 2_000  # seeds per evaluation (BATCH x vocab floats of noise)

Rule = Callable[[int, int], Keyed]  # (seed, width) -> the sampler a request would get


class SeedBlind(Keyed):
    """Sabotage: the noise of seed 0 whatever the seed."""

    def noise(self, position: int, width: int | None = None) -> mx.array:
        return Keyed(0, self.width).noise(position, width)


class Reused(Keyed):
    """Sabotage: position 0's noise at every position."""

    def noise(self, position: int, width: int | None = None) -> mx.array:
        return super().noise(0, width)


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[Any, list[int], int]]:
    loaded = load_for_compute(target_dir())
    yield loaded.model, loaded.tokenizer.encode(snippet()), output_width(loaded.model)


# The seeds' noise rows by (rule, width, position, first seed, last seed + 1): they do not
# depend on the temperature, so the three temperatures' gates make them once.
_NOISE: dict[tuple[Rule, int, int, int, int], mx.array] = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_noise() -> Iterator[None]:
    yield
    _NOISE.clear()


def _noise(rule: Rule, width: int, position: int, seeds: range) -> mx.array:
    key = (rule, width, position, seeds.start, seeds.stop)
    if key not in _NOISE:
        _NOISE[key] = mx.stack([rule(s, width).noise(position) for s in seeds])
        mx.eval(_NOISE[key])
    return _NOISE[key]


def _draw(rule: Rule, width: int, rows: mx.array, position: int, seeds: range,
          pick: np.ndarray | None = None) -> np.ndarray:
    """Each seed's token at `position` from filtered logits `rows` (one row, or one per
    seed chosen by `pick`), as `Keyed.token` draws it."""
    filtered = rows if pick is None else rows[mx.array(pick)]
    return np.array(mx.argmax(filtered + _noise(rule, width, position, seeds), axis=-1))


def _gate(model: Any, ids: list[int], width: int, temperature: float, rule: Rule,
          seeds: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """(chi-square, df) of position 0 alone and of positions 0 and 1 together."""
    params = SamplingParams(temperature=temperature, top_k=20, top_p=0.95)
    logits = model(mx.array(ids, dtype=mx.uint32)[None], cache=make_cache(model, "fp16"))[0]
    probs = mx.softmax(filter_logits(logits, params), axis=-1)
    entropy = -(probs * mx.log(mx.maximum(probs, 1e-30))).sum(axis=-1)
    at = int(mx.argmax(entropy).item())  # the widest position: the most bins
    f0 = filter_logits(logits[at], params)
    p0 = np.array(mx.softmax(f0), dtype=np.float64)
    support = np.nonzero(p0 > 0)[0]
    # p(y | x) for every x the first position can take: one forward per candidate.
    batch = mx.array([[*ids[: at + 1], int(x)] for x in support], dtype=mx.uint32)
    f1 = filter_logits(model(batch, cache=make_cache(model, "fp16"))[:, -1], params)
    p1 = np.array(mx.softmax(f1, axis=-1), dtype=np.float64)
    row_of = np.full(width, -1)
    row_of[support] = np.arange(len(support))

    # The batched draw is the sampler's own: Keyed.token on the same rows agrees.
    probe = range(50)
    first = _draw(rule, width, f0[None], 0, probe)
    assert first.tolist() == [int(rule(s, width).token(logits[at][None], params, 0).item())
                              for s in probe]

    marginal = np.zeros(width)
    joint = np.zeros(len(support) * width)
    for start in range(0, seeds, BATCH):
        chunk = range(start, min(seeds, start + BATCH))
        xs = _draw(rule, width, f0[None], 0, chunk)
        rows = row_of[xs]
        assert (rows >= 0).all(), "a token outside top-k/top-p was drawn"
        ys = _draw(rule, width, f1, 1, chunk, pick=rows)
        marginal += np.bincount(xs, minlength=width)
        joint += np.bincount(rows * width + ys, minlength=len(support) * width)
    one = chi_square(marginal, p0, seeds)
    both = chi_square(joint, (p0[support][:, None] * p1).ravel(), seeds)
    print(f"T={temperature} {getattr(rule, '__name__', 'keyed')}: position {at}, "
          f"{len(support)} tokens; one position chi2={one[0]:.1f} df={one[1]} "
          f"critical(0.001)={chi2_critical(one[1]):.1f}; two positions chi2={both[0]:.1f} "
          f"df={both[1]} critical(0.001)={chi2_critical(both[1]):.1f}")
    return one, both


@pytest.mark.parametrize("temperature", [0.4, 0.7, 1.0])
def test_keyed_draws_follow_the_target_alone_and_in_pairs(target, temperature: float) -> None:
    """Over seeds, one position follows p and two consecutive positions p(x) p(y | x)."""
    (one, df1), (both, df2) = _gate(*target, temperature, Keyed, SEEDS)
    assert one < chi2_critical(df1)
    assert both < chi2_critical(df2)


def test_noise_that_ignores_the_seed_fails_the_gate(target) -> None:
    """Every seed the same answer: both tests fail."""
    (one, df1), (both, df2) = _gate(*target, 0.7, SeedBlind, 1_000)
    assert one > chi2_critical(df1) and both > chi2_critical(df2)


def test_noise_reused_at_consecutive_positions_fails_only_the_joint_test(target) -> None:
    """One position's draws are still right; the pair is not, and the joint test says so."""
    (one, df1), (both, df2) = _gate(*target, 1.0, Reused, SEEDS)
    assert one < chi2_critical(df1)
    assert both > chi2_critical(df2)

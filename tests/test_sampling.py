"""Sampling: filters keep the right tokens, and a seed fixes the draw."""

import mlx.core as mx
import numpy as np

from seatd.sampling import KeyChain, filter_logits, sample
from shared.protocol import SamplingParams

LOGITS = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])


def kept(params: SamplingParams) -> list[int]:
    out = np.array(filter_logits(LOGITS, params))[0]
    return [i for i, v in enumerate(out) if np.isfinite(v)]


def test_top_k_keeps_k_best() -> None:
    """top_k keeps exactly the k most likely tokens."""
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_smallest_nucleus() -> None:
    """top_p keeps tokens until their mass reaches p; the best token always stays."""
    probs = np.array(mx.softmax(LOGITS, axis=-1))[0]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.01)) == [0]


def test_greedy_at_zero_temperature() -> None:
    """Temperature 0 is argmax, whatever the key."""
    p = SamplingParams(temperature=0.0)
    assert int(sample(LOGITS, p, KeyChain(1).next()).item()) == 0


def test_same_seed_same_tokens() -> None:
    """Two key chains from one seed draw the same sequence; another seed differs."""
    p = SamplingParams(temperature=1.5)
    flat = mx.zeros((1, 1000))

    def draw(seed: int) -> list[int]:
        keys = KeyChain(seed)
        return [int(sample(flat, p, keys.next()).item()) for _ in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)

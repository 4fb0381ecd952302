"""Token sampling with explicit PRNG keys, so a seed fixes the whole answer.

`filter_logits` is kept apart from the draw so that a verifier can compare the
same filtered distribution a plain step samples from.
"""

from __future__ import annotations

import os

import mlx.core as mx

from shared.protocol import SamplingParams


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature, then top-k, then top-p; masked entries become -inf."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k : vocab - params.top_k + 1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if params.top_p < 1.0:
        # Keep the smallest set of best tokens whose mass reaches top_p: everything at or
        # above the logit of the last token kept (one sort, no inverse permutation).
        sorted_logits = -mx.sort(-logits, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        kept = (before < params.top_p).sum(axis=-1, keepdims=True)
        cutoff = mx.take_along_axis(sorted_logits, kept - 1, axis=-1)
        logits = mx.where(logits >= cutoff, logits, -mx.inf)
    return logits


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token per row of `logits`; greedy at temperature 0."""
    if params.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, params), axis=-1, key=key)


class KeyChain:
    """Deterministic per-step keys from one request seed."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed & 0xFFFFFFFF)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

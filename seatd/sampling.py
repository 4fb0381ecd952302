"""Token sampling: two rules, chosen by whether the request brings a seed.

Seeded requests draw by a **keyed** rule.  Every random number is a pure function of
(seed, answer position): position i's token is

    argmax(filter(logits_i) + Gumbel(key(seed, i)))

which is a draw from the filtered softmax (the Gumbel-max trick).  Nothing else
enters: not the clock, not the seat's history, not how many rounds or drafts came
before, not another request.  Speculation proposes with the same noise and keeps a
draft while it equals the target's own keyed token (`seatd.verify`), so what a seat
does to go fast cannot change a seeded answer (Daliri, Musco and Suresh, "Coupling
without communication and drafter-invariant speculative decoding", 2024).

Unseeded requests draw by a **chained** rule: keys from OS entropy, one per draw, and
speculative rounds use rejection sampling, which accepts more drafts above
temperature 0 than the keyed rule's coupling can.

`filter_logits` (temperature, top-k, top-p, min_p) is kept apart from the draw so that
a verifier compares the same filtered distribution a plain step samples from.  Logits
reach it already shaped (`seatd.shaping`: grammar mask, penalties, bias).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence

import mlx.core as mx

from shared.protocol import SamplingParams

MASK64 = (1 << 64) - 1
KEYED_RULE = "gumbel-v1"  # named in the seat's fingerprint: changing it changes answers


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature, then top-k, then top-p, then min_p; masked entries become -inf.

    min_p drops tokens whose probability is below min_p times the best one's: in logits,
    those below the best logit + log(min_p) (the best token always stays)."""
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
    if params.min_p > 0.0:
        floor = logits.max(axis=-1, keepdims=True) + math.log(params.min_p)
        logits = mx.where(logits < floor, -mx.inf, logits)
    return logits


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token per row of `logits`; greedy at temperature 0."""
    if params.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, params), axis=-1, key=key)


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def position_word(seed: int, position: int) -> int:
    """The 64-bit seed of answer position `position`'s key (`position_key`)."""
    return _mix64((_mix64(seed & MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & MASK64)


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key of answer position `position` of a request seeded `seed`.

    Counter-based: a pure function of the pair, computed directly for any position (no
    chain to advance).  Distinct positions of one seed get distinct keys."""
    return mx.random.key(position_word(seed, position))


class Chained:
    """Unseeded draws: a fresh key for every draw, from OS entropy (or a fixed start)."""

    keyed = False

    def __init__(self, start: int | None = None) -> None:
        if start is None:
            start = int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(start & 0xFFFFFFFF)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def token(self, logits: mx.array, params: SamplingParams, position: int) -> mx.array:
        """One token per row of `logits` (the position does not matter to this rule)."""
        return sample(logits, params, self.next_key())


class Keyed:
    """Seeded draws: position i's token is argmax(filter(logits) + Gumbel(key(seed, i))).

    `width` is the target's output width: noise is always made at that width (MLX's
    random values depend on the shape asked for), and a drafter with another width
    gets the same values cut or padded, so target and drafter share every draw."""

    keyed = True

    def __init__(self, seed: int, width: int) -> None:
        self.seed = seed
        self.width = width
        self._rows: dict[int, mx.array] = {}

    def noise(self, position: int, width: int | None = None) -> mx.array:
        """Gumbel noise of one position, (width,): the same values on every call."""
        row = self._rows.get(position)
        if row is None:
            if len(self._rows) > 64:  # a round looks at most a few positions ahead
                self._rows = {p: r for p, r in self._rows.items() if p >= position}
            row = mx.random.gumbel(shape=(self.width,), key=position_key(self.seed, position))
            self._rows[position] = row
        width = self.width if width is None else width
        if width < self.width:
            return row[:width]
        if width > self.width:  # tokens the target cannot emit never win
            return mx.concatenate([row, mx.full((width - self.width,), -mx.inf)])
        return row

    def scores(self, logits: mx.array, params: SamplingParams, position: int) -> mx.array:
        """Perturbed scores of rows at positions position, position + 1, ... along the
        second-to-last axis ((V,) is one position); at temperature 0 the logits."""
        if params.temperature == 0:
            return logits
        width = logits.shape[-1]
        if logits.ndim == 1:
            return filter_logits(logits, params) + self.noise(position, width)
        rows = logits.shape[-2]
        noise = mx.stack([self.noise(position + i, width) for i in range(rows)])
        return filter_logits(logits, params) + noise

    def token(self, logits: mx.array, params: SamplingParams, position: int) -> mx.array:
        """The canonical token of `position`, per row of `logits` (B, V) -> (B,)."""
        if params.temperature == 0:
            return mx.argmax(logits, axis=-1)
        scores = filter_logits(logits, params) + self.noise(position, logits.shape[-1])
        return mx.argmax(scores, axis=-1)


def _keys(words: Sequence[int]) -> mx.array:
    """`mx.random.key` of each word, stacked (n, 2): its high and low 32 bits."""
    return mx.array([[w >> 32, w & 0xFFFFFFFF] for w in words], dtype=mx.uint32)


@functools.cache
def _gumbel_rows(width: int) -> Callable[[mx.array], mx.array]:
    """Gumbel noise of shape (width,) for each key of a stack of keys, in one call."""
    return mx.vmap(lambda key: mx.random.gumbel(shape=(width,), key=key))


def rows_draw_alike(width: int) -> bool:
    """Whether this process's backend draws a stack of keys (`_gumbel_rows`) bit for bit
    as it draws each key alone (`mx.random.gumbel`), at this width: asked once per width
    and device.  Where it does not, each row draws alone."""
    return _alike(width, str(mx.default_device()))


@functools.cache
def _alike(width: int, device: str) -> bool:
    words = [position_word(seed, 0) for seed in (1, 2, 3)]
    together = _gumbel_rows(width)(_keys(words))
    alone = mx.stack([mx.random.gumbel(shape=(width,), key=mx.random.key(w)) for w in words])
    return bool(mx.array_equal(together, alone).item())


def keyed_noise(draws: Sequence[Keyed], positions: Sequence[int], width: int) -> mx.array:
    """The noise of several keyed draws, each at its position, (n, width): row i is
    `draws[i].noise(positions[i], width)`, bit for bit, drawn in one random call for
    all rows where they are drawn at their own width and the backend draws a stack of
    keys as it draws each alone (`rows_draw_alike`), else one call a row (or the noise
    a draw already holds).  Nothing drawn together is kept: a batch's plain step is
    the last to ask for its position's noise."""
    if len(draws) > 1 and all(d.width == width for d in draws) and rows_draw_alike(width):
        return _gumbel_rows(width)(_keys([position_word(d.seed, p)
                                          for d, p in zip(draws, positions, strict=True)]))
    return mx.stack([d.noise(p, width) for d, p in zip(draws, positions, strict=True)])


Draws = Chained | Keyed


def draws_for(params: SamplingParams, width: int) -> Draws:
    """The rule a request samples by: keyed when it has a seed."""
    if params.seed is not None:
        return Keyed(params.seed, width)
    return Chained()

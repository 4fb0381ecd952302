"""The shaping arithmetic on small arrays (`seatd.shaping`, min_p in `seatd.sampling`):
penalties, bias, masks, block counts equal to sequential application, the drafter's
cursor, log-probabilities.  `FakeMatcher` implements the grammar interface the engine
uses (seatd/grammar.py's `Matcher`) for these tests and tests/test_shaped_spec.py."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from seatd.sampling import filter_logits
from seatd.shaping import (
    Shaper,
    apply_mask,
    block_counts,
    fit,
    logprob_arrays,
    penalize,
    token_logprobs,
)
from shared.protocol import SamplingParams


class FakeMatcher:
    """A grammar that forbids a fixed set of tokens; with `length`, after that many
    tokens only `end` is allowed, and it is finished once `end` is consumed."""

    def __init__(self, width: int, forbidden: set[int], length: int | None = None,
                 end: int = 0) -> None:
        self.width = width
        self.forbidden = set(forbidden)
        self.length = length
        self.end = end
        self.taken: list[int] = []
        self.done = False

    def _mask_after(self, taken: int, done: bool) -> np.ndarray:
        allowed = np.ones(self.width, dtype=bool)
        if done:
            return np.zeros(self.width, dtype=bool)
        if self.length is not None and taken >= self.length:
            allowed[:] = False
            allowed[self.end] = True
            return allowed
        allowed[list(self.forbidden)] = False
        if self.length is not None:
            allowed[self.end] = False
        return allowed

    def _allows(self, taken: int, done: bool, token: int) -> bool:
        return bool(self._mask_after(taken, done)[token])

    def mask(self) -> mx.array:
        return mx.array(self._mask_after(len(self.taken), self.done))

    def masks_along(self, tokens: Sequence[int]) -> tuple[mx.array, int]:
        taken, done = len(self.taken), self.done
        rows = [self._mask_after(taken, done)]
        n = 0
        for t in tokens:
            if not self._allows(taken, done, t):
                break
            done = done or (self.length is not None and t == self.end)
            taken += 1
            n += 1
            rows.append(self._mask_after(taken, done))
        return mx.array(np.stack(rows)), n

    def consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self._allows(len(self.taken), self.done, t):
                raise ValueError(f"token {t} is not allowed here")
            self.taken.append(t)
            if self.length is not None and t == self.end:
                self.done = True

    @property
    def finished(self) -> bool:
        return self.done


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


LOGITS = mx.array([2.0, -1.0, 0.5, 1.0])


@pytest.mark.parametrize(("counts", "seen", "presence", "frequency", "repetition", "want"), [
    # nothing to do
    ([0, 0, 0, 0], None, 0.0, 0.0, 1.0, [2.0, -1.0, 0.5, 1.0]),
    # frequency: minus frequency * count
    ([0, 2, 1, 0], None, 0.0, 0.25, 1.0, [2.0, -1.5, 0.25, 1.0]),
    # presence: minus presence once a token is in the answer, whatever its count
    ([0, 2, 1, 0], None, 0.5, 0.0, 1.0, [2.0, -1.5, 0.0, 1.0]),
    # both
    ([0, 2, 1, 0], None, 0.5, 0.25, 1.0, [2.0, -2.0, -0.25, 1.0]),
    # negative penalties encourage repetition (OpenAI allows -2..2)
    ([3, 0, 0, 0], None, -1.0, -0.5, 1.0, [4.5, -1.0, 0.5, 1.0]),
    # repetition over the prompt's tokens: > 0 divided, < 0 multiplied
    ([0, 0, 0, 0], [True, True, False, False], 0.0, 0.0, 2.0, [1.0, -2.0, 0.5, 1.0]),
    # repetition over the answer's tokens too (counts > 0 are seen)
    ([0, 0, 1, 0], [True, False, False, False], 0.0, 0.0, 2.0, [1.0, -1.0, 0.25, 1.0]),
    # repetition below 1 raises seen tokens
    ([0, 0, 0, 0], [True, True, False, False], 0.0, 0.0, 0.5, [4.0, -0.5, 0.5, 1.0]),
])
def test_penalties(counts: list[float], seen: list[bool] | None, presence: float,
                   frequency: float, repetition: float, want: list[float]) -> None:
    """Repetition (vLLM/HF), then frequency and presence (OpenAI), on one position."""
    got = penalize(LOGITS, mx.array(counts, dtype=mx.float32),
                   mx.array(seen) if seen is not None else None,
                   presence, frequency, repetition)
    np.testing.assert_allclose(_np(got), want, rtol=1e-6)


def test_shaper_order_mask_penalties_bias() -> None:
    """A shaper: prompt tokens seen, prefix tokens counted, bias added, and a masked
    token stays -inf whatever its bias."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=2.0, logit_bias=((3, 5.0), (2, -1.0)))
    shaper = Shaper(params, 4, prompt=[0, 0], prefix=[2])
    got = _np(shaper.apply(LOGITS, shaper.counts, None))
    # 0: seen in the prompt -> 2/2; 2: in the answer once -> 0.5/2 - 0.25 - 0.5 - 1
    np.testing.assert_allclose(got, [1.0, -1.0, -1.5, 6.0], rtol=1e-6)
    masked = _np(shaper.apply(LOGITS, shaper.counts, mx.array([True, True, True, False])))
    assert masked[3] == -np.inf and masked[0] == 1.0


def test_a_row_with_nothing_to_shape_has_no_shaper() -> None:
    """The common case costs nothing: no shaper, so no operation joins the step."""
    assert Shaper.for_row(SamplingParams(temperature=0.7, top_p=0.9), 8, [1, 2]) is None
    assert Shaper.for_row(SamplingParams(min_p=0.1, logprobs=3), 8, [1]) is None
    assert Shaper.for_row(SamplingParams(frequency_penalty=0.1), 8, [1]) is not None
    assert Shaper.for_row(SamplingParams(logit_bias=((1, 1.0),)), 8, [1]) is not None
    assert Shaper.for_row(SamplingParams(), 8, [1], grammar=FakeMatcher(8, set())) is not None


@pytest.mark.parametrize(("min_p", "kept"), [
    (0.0, [0, 1, 2, 3]),
    (0.35, [0, 1, 3]),  # probabilities .5 .2 .1 .2: below .175 goes
    (0.5, [0]),
    (1.0, [0]),  # only the best
])
def test_min_p(min_p: float, kept: list[int]) -> None:
    """min_p drops tokens below min_p times the best token's probability."""
    logits = mx.log(mx.array([[0.5, 0.2, 0.1, 0.2]]))
    got = _np(filter_logits(logits, SamplingParams(min_p=min_p)))[0]
    assert [i for i in range(4) if np.isfinite(got[i])] == kept


def test_min_p_comes_after_temperature() -> None:
    """At a high temperature the distribution flattens and min_p keeps more."""
    logits = mx.log(mx.array([[0.5, 0.2, 0.1, 0.2]]))
    got = _np(filter_logits(logits, SamplingParams(min_p=0.35, temperature=4.0)))[0]
    assert np.isfinite(got).all()


def test_masks_and_widths() -> None:
    """A mask makes forbidden tokens -inf; a mask or vector of another width is cut or
    padded (tokens past a mask are forbidden)."""
    got = _np(apply_mask(LOGITS, mx.array([True, False, True])))
    assert list(np.isfinite(got)) == [True, False, True, False]
    assert _np(fit(mx.array([1.0, 2.0]), 4, 0.0)).tolist() == [1.0, 2.0, 0.0, 0.0]
    assert _np(fit(mx.array([1.0, 2.0, 3.0]), 2, 0.0)).tolist() == [1.0, 2.0]


def test_block_counts_equal_sequential_application() -> None:
    """A block after drafts d: row i is the base counts plus d[:i]'s, and a shaped block
    equals shaping each position after advancing through the drafts one by one."""
    rng = np.random.default_rng(0)
    width = 16
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3,
                            repetition_penalty=1.3, logit_bias=((5, 2.0),))
    prompt, prefix = [1, 2, 3], [4, 4, 9]
    drafts = [4, 7, 7, 1, 9]
    base = Shaper(params, width, prompt, prefix)
    counts = _np(block_counts(base.counts, mx.array(drafts)))  # type: ignore[arg-type]
    for i in range(len(drafts) + 1):
        want = np.bincount(prefix + drafts[:i], minlength=width)
        assert counts[i].tolist() == want.tolist(), i
    logits = mx.array(rng.normal(size=(1, len(drafts) + 1, width)).astype(np.float32))
    block = _np(base.shape_block(logits, mx.array(drafts, dtype=mx.uint32), None))[0]
    walk = Shaper(params, width, prompt, prefix)
    for i in range(len(drafts) + 1):
        one = _np(walk.shape(logits[:, i, :]))[0]
        np.testing.assert_array_equal(block[i], one)
        if i < len(drafts):
            walk.advance(mx.array([drafts[i]], dtype=mx.uint32))
    cursor = Shaper(params, width, prompt, prefix).cursor()
    for i in range(len(drafts) + 1):
        np.testing.assert_array_equal(block[i], _np(cursor.shape(logits[:, i, :]))[0])
        if i < len(drafts):
            cursor.push(mx.array([drafts[i]], dtype=mx.uint32))
    assert _np(base.counts).tolist() == np.bincount(prefix, minlength=width).tolist()  # type: ignore[arg-type]


def test_a_cursor_follows_the_grammar_and_leaves_it_as_it_was() -> None:
    """The drafter's walk masks each drafted position as the grammar would after the
    drafts before it, without moving the grammar."""
    grammar = FakeMatcher(8, {3}, length=2, end=0)
    shaper = Shaper(SamplingParams(), 8, [1], grammar=grammar)
    cursor = shaper.cursor()
    logits = mx.zeros((1, 8))
    first = _np(cursor.shape(logits))[0]
    assert not np.isfinite(first[3]) and not np.isfinite(first[0])
    cursor.push(mx.array([5], dtype=mx.uint32))
    cursor.push(mx.array([6], dtype=mx.uint32))
    last = _np(cursor.shape(logits))[0]
    assert [i for i in range(8) if np.isfinite(last[i])] == [0]  # only the end now
    assert grammar.taken == []


class _Tok:
    def decode(self, ids: Sequence[int]) -> str:
        return "".join("é" if i == 2 else f"<{i}>" for i in ids)


def test_logprobs_are_the_raw_log_softmax_with_sorted_alternatives() -> None:
    """A token's logprob is log_softmax of the raw logits; alternatives best first; the
    greedy token's logprob is the top one's; bytes are the text's UTF-8."""
    logits = mx.array([[0.1, 3.0, 2.0, -1.0, 2.5], [1.0, 1.0, 4.0, 0.0, 0.0]])
    tokens = mx.array([1, 3])
    arrays = logprob_arrays(logits, tokens, 3)
    mx.eval(*arrays)
    lps = token_logprobs(_Tok(), [1, 3], arrays)
    want = _np(logits) - np.log(np.exp(_np(logits)).sum(axis=-1, keepdims=True))
    assert lps[0].logprob == pytest.approx(want[0, 1], abs=1e-5)
    assert lps[1].logprob == pytest.approx(want[1, 3], abs=1e-5)
    assert [t for t, _ in lps[0].top] == ["<1>", "<4>", "é"]
    assert lps[0].top[0][1] == pytest.approx(lps[0].logprob)  # greedy: the best one
    assert lps[1].top[0][0] == "é" and lps[1].bytes == tuple(b"<3>")
    for lp in lps:
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    none = logprob_arrays(logits, tokens, 0)
    mx.eval(*none)
    assert [lp.top for lp in token_logprobs(_Tok(), [1, 3], none)] == [(), ()]

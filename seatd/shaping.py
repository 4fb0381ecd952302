"""Shaping of a row's logits before the draw: grammar mask, penalties, logit bias.

One `Shaper` per row that asks for any of it (`Shaper.for_row` is None otherwise: a
row with nothing to shape adds no operation to a step).  The same arithmetic runs in
the plain step, at every position of a verified block (given the draft tokens before
it) and in a model drafter's proposal, so a draft is judged against exactly the
distribution the plain path samples from, and a seeded answer never depends on
speculation.  In order, on the raw logits of the position:

    mask         a grammar's forbidden tokens become -inf (`Matcher`, seatd/grammar.py)
    repetition   tokens seen in the prompt or the answer so far: a logit > 0 is divided
                 by `repetition_penalty`, one < 0 multiplied by it (vLLM / HF)
    frequency,   logit[j] -= frequency * c[j] + presence * (c[j] > 0), c[j] the count
    presence     of token j among the answer tokens before this position (OpenAI; a
                 continued answer's prefix tokens count)
    bias         `logit_bias` added (ids past a drafter's narrower width are left out)

then `seatd.sampling.filter_logits` (temperature, top-k, top-p, min_p) and the draw.

Penalty state lives on the device: a (width,) float32 count vector and a (width,)
bool seen vector, advanced with the sampled tokens while they are still lazy, so plain
steps stay pipelined.  A block of n positions after draft tokens d sees counts
`base + exclusive cumsum(one_hot(d))`.  A grammar mask needs the host's token, so a
row with a grammar has its tokens read before its next step.

Log-probabilities (`SamplingParams.logprobs`) come from log_softmax of the target's
raw logits at the position (before shaping and temperature): the model's own
distribution, as OpenAI reports it.  A token's text is `tokenizer.decode([id])`, its
bytes that text's UTF-8 (a token that is part of one multi-byte character decodes to
U+FFFD: its bytes are those of U+FFFD, not the token's raw bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from shared.protocol import SamplingParams, TokenLogprob


class Matcher(Protocol):
    """A grammar's state over an answer (seatd/grammar.py implements it)."""

    def mask(self) -> mx.array:
        """(width,) bool: True where a token is allowed now."""
        ...

    def masks_along(self, tokens: Sequence[int]) -> tuple[mx.array, int]:
        """(n + 1, width) masks at the current state and after each allowed leading
        token, and n, how many leading tokens are allowed; the state is unchanged."""
        ...

    def consume(self, tokens: Sequence[int]) -> None: ...

    @property
    def finished(self) -> bool: ...


# -- the arithmetic (pure, on arrays) -------------------------------------------------


def fit(vector: mx.array, width: int, fill: float | bool) -> mx.array:
    """A (..., W) vector cut or padded (with `fill`) to (..., width): a drafter whose
    output width differs from the target's shapes its own logits with it."""
    have = vector.shape[-1]
    if have == width:
        return vector
    if have > width:
        return vector[..., :width]
    pad = mx.full((*vector.shape[:-1], width - have), fill, dtype=vector.dtype)
    return mx.concatenate([vector, pad], axis=-1)


def one_hot(tokens: mx.array, width: int) -> mx.array:
    """(n,) token ids -> (n, width) float32 rows with a 1 at each id."""
    return (tokens.astype(mx.int32)[:, None] == mx.arange(width)[None, :]).astype(mx.float32)


def block_counts(base: mx.array, drafts: mx.array) -> mx.array:
    """Answer-token counts at each position of a block fed after draft tokens `drafts`
    (k,): (k + 1, width), row i = base + counts of drafts[:i]."""
    width = base.shape[-1]
    if drafts.shape[0] == 0:
        return base[None]
    seen = mx.cumsum(one_hot(drafts, width), axis=0)
    return mx.concatenate([base[None], base[None] + seen], axis=0)


def penalize(logits: mx.array, counts: mx.array | None, seen: mx.array | None,
             presence: float, frequency: float, repetition: float) -> mx.array:
    """Repetition (over `seen`), then frequency and presence (over `counts`); counts and
    seen broadcast against logits (..., width)."""
    if seen is not None and repetition != 1.0:
        hit = seen if counts is None else mx.logical_or(seen, counts > 0)
        scaled = mx.where(logits > 0, logits / repetition, logits * repetition)
        logits = mx.where(hit, scaled, logits)
    if counts is not None:
        if frequency != 0.0:
            logits = logits - frequency * counts
        if presence != 0.0:
            logits = logits - presence * (counts > 0).astype(logits.dtype)
    return logits


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    """Forbidden tokens (mask False) become -inf; a mask of another width is fitted
    (tokens past it are forbidden)."""
    mask = fit(mask.astype(mx.bool_), logits.shape[-1], False)
    return mx.where(mask, logits, -mx.inf)


# -- a row's state --------------------------------------------------------------------


class Shaper:
    """One row's shaping state: its answer-token counts, the tokens it has seen, its
    bias, its grammar (already past a continued answer's prefix; the engine feeds it
    the answer's tokens as they are taken)."""

    def __init__(self, params: SamplingParams, width: int, prompt: Sequence[int],
                 prefix: Sequence[int] = (), grammar: Matcher | None = None) -> None:
        self.width = width
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.grammar = grammar
        self.counts: mx.array | None = None
        self.seen: mx.array | None = None
        self.bias: mx.array | None = None
        if self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0:
            # Counts double as the answer's share of `seen`: one vector to advance.
            self.counts = _counts(prefix, width)
        if self.repetition != 1.0:
            self.seen = _counts(prompt, width) > 0
        kept = [(t, b) for t, b in params.logit_bias if 0 <= t < width]
        if kept:
            # A scatter, never an (entries, width) one-hot: 1,024 entries of a 152k
            # vocabulary would be 620 MB.  Repeated ids add up (a client's JSON object
            # cannot repeat one anyway); evaluated here, not inside a batch step.
            self.bias = mx.zeros((width,), dtype=mx.float32).at[
                mx.array([t for t, _ in kept], dtype=mx.int32)].add(
                mx.array([b for _, b in kept], dtype=mx.float32))
            mx.eval(self.bias)

    @classmethod
    def for_row(cls, params: SamplingParams, width: int, prompt: Sequence[int],
                prefix: Sequence[int] = (), grammar: Matcher | None = None) -> Shaper | None:
        """The row's shaper, or None when it has nothing to shape."""
        if (grammar is None and params.presence_penalty == 0.0
                and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
                and not params.logit_bias):
            return None
        return cls(params, width, prompt, prefix, grammar)

    @property
    def state(self) -> list[mx.array]:
        """The device arrays a step must evaluate with its tokens (so that the chain of
        lazy updates never grows)."""
        return [a for a in (self.counts,) if a is not None]

    def apply(self, logits: mx.array, counts: mx.array | None, mask: mx.array | None
              ) -> mx.array:
        """Shape logits (..., w) given the counts at their positions (broadcasting)."""
        logits = logits.astype(mx.float32)
        w = logits.shape[-1]
        if mask is not None:
            logits = apply_mask(logits, mask)
        seen = fit(self.seen, w, False) if self.seen is not None else None
        if counts is not None:
            counts = fit(counts, w, 0.0)
        logits = penalize(logits, counts, seen, self.presence, self.frequency,
                          self.repetition)
        if self.bias is not None:
            logits = logits + fit(self.bias, w, 0.0)
        return logits

    def shape(self, logits: mx.array, mask: mx.array | None = None) -> mx.array:
        """One position's logits (1, w) or (w,) at the row's current state; under a
        grammar, its `mask()` now unless the caller has it already."""
        if mask is None and self.grammar is not None:
            mask = self.grammar.mask()
        return self.apply(logits, self.counts, mask)

    def shape_block(self, logits: mx.array, drafts: mx.array, masks: mx.array | None
                    ) -> mx.array:
        """A verified block's logits (1, k + 1, w) after draft tokens `drafts` (k,);
        `masks` (k + 1, width) from the grammar's `masks_along`, when it has one."""
        counts = block_counts(self.counts, drafts) if self.counts is not None else None
        return self.apply(logits, counts, masks)

    def advance(self, tokens: mx.array) -> None:
        """Answer tokens (n,) taken (lazy is fine): the counts follow them."""
        if self.counts is not None and tokens.shape[0] > 0:
            self.counts = self.counts + one_hot(tokens, self.width).sum(axis=0)

    def cursor(self) -> Cursor:
        """A copy of the state for a drafter to step through its own proposal."""
        return Cursor(self)


class Cursor:
    """A drafter's walk ahead of the row: counts advanced with each drafted token, and
    the grammar's mask after them (through `masks_along`, which leaves the matcher as
    it was); the row's own state never moves."""

    def __init__(self, shaper: Shaper) -> None:
        self.shaper = shaper
        self.counts = shaper.counts
        self.drafted: list[int] = []

    def shape(self, logits: mx.array) -> mx.array:
        grammar = self.shaper.grammar
        mask = None
        if grammar is not None:
            if self.drafted:
                masks, n = grammar.masks_along(self.drafted)
                mask = masks[n]  # past a forbidden draft the verifier cuts it anyway
            else:
                mask = grammar.mask()
        return self.shaper.apply(logits, self.counts, mask)

    def push(self, token: mx.array) -> None:
        """A drafted token (1,), lazy; read on the host only under a grammar."""
        if self.counts is not None:
            self.counts = self.counts + one_hot(token.reshape(-1), self.shaper.width)[0]
        if self.shaper.grammar is not None:
            value: Any = token.reshape(-1)[0].item()
            self.drafted.append(int(value))


def _counts(ids: Sequence[int], width: int) -> mx.array:
    counts = mx.zeros((width,), dtype=mx.float32)
    kept = [int(t) for t in ids if 0 <= int(t) < width]
    if kept:
        counts = counts.at[mx.array(kept, dtype=mx.int32)].add(1.0)
    return counts


# -- log-probabilities ----------------------------------------------------------------


def logprob_arrays(logits: mx.array, tokens: mx.array, top: int
                   ) -> tuple[mx.array, mx.array, mx.array]:
    """Raw logits (n, V) and the token taken at each position (n,) -> (their log-probs
    (n,), the `top` best ids (n, top) and their log-probs (n, top), best first); lazy."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if top <= 0:
        empty = mx.zeros((logits.shape[0], 0), dtype=mx.int32)
        return chosen, empty, empty.astype(mx.float32)
    top = min(top, logits.shape[-1])
    # The `top` best in any order (no sort of the whole vocabulary), then sorted.
    best = mx.argpartition(-logp, kth=top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(logp, best, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return (chosen, mx.take_along_axis(best, order, axis=-1),
            mx.take_along_axis(values, order, axis=-1))


def token_logprobs(tokenizer: Any, tokens: Sequence[int], arrays: tuple[mx.array, ...]
                   ) -> list[TokenLogprob]:
    """TokenLogprobs of `tokens` from evaluated `logprob_arrays` (host side)."""
    chosen, ids, values = (a.tolist() for a in arrays)
    out = []
    for i, token in enumerate(tokens):
        text = _text(tokenizer, token)
        top = tuple((_text(tokenizer, int(t)), float(v))
                    for t, v in zip(ids[i], values[i], strict=True))  # type: ignore[index, arg-type]
        out.append(TokenLogprob(text, float(chosen[i]),  # type: ignore[index, arg-type]
                                tuple(text.encode("utf-8")), top))
    return out


def _text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([int(token)]))

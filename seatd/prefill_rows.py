"""Joining rows prefilled together: their caches stacked into one batch of mlx-lm caches
at one offset, one forward for all of them, and split again as each row's prompt is in.

    stackable(cache)       every layer is a type this module can stack
    stack(caches)          caches at one offset (B rows each) -> one cache of all rows
    take(cache, index, end)  row `index` of a stacked cache, as a cache of its own
                           (its first `end` tokens: a padded row's own)
    keep(cache, indices)   the stacked cache of those rows only
    padded(ends, limit, fit, context)  how far one forward takes a group whose rows'
                           prompts end at different points (the shorter ones padded)
    join_point(prompt_len, cuts, chunk)   where a row's prefill ends (its last turn cut,
                           where only its answer's header follows)
    unpaced_tokens(fit, rows, context, chunk, floor)   prompt tokens a row for a step
                           nobody keeps a pace for

Rows at one offset need no padding and no mask beyond mlx-lm's own causal one, so a
joining group is plain mlx-lm caches with a batch axis; the batch engine
(`seatd.batch`) prefills the group that is furthest behind first, so that rows arriving
later catch up with a group in progress and merge with it where their offsets meet.

A prefill forward of a few dozen tokens costs mostly its fixed part (reading the
weights, launching the layers), so several joining rows in one forward cost little more
than one; and a prompt token costs more the further into its prompt it is (it attends
to every token before it: on a CPU a 16-token piece at 1,400 tokens in costs twice one
at the start).  `PrefillCost` is that measured cost, and says how many prompt tokens a
step may take within a time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from seatd.recurrent import RollbackArraysCache

WINDOW = 32  # prefill steps the cost fit looks back on
# Steps beside decoding rows are small and alike, so a fit over those alone cannot tell
# the fixed part from the per-token one (and, over-estimating, keeps them small): the
# last few big steps (a chunk with nobody waiting) stay in the fit as well.
BIG_STEP = 128  # tokens
BIG_WINDOW = 8


KV_LAYERS = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)  # mlx-lm's KV layer caches


def stackable(cache: Sequence[Any]) -> bool:
    """Every layer is mlx-lm's KV (plain or quantized) or recurrent arrays cache."""
    return all(type(c) in (*KV_LAYERS, mlx_cache.ArraysCache, RollbackArraysCache)
               for c in cache)


def _parts(x: Any) -> list[mx.array]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _like(c: Any) -> Any:
    """An empty cache of the same kind as layer `c`."""
    if type(c) is mlx_cache.QuantizedKVCache:
        return mlx_cache.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if type(c) is mlx_cache.KVCache:
        return mlx_cache.KVCache()  # type: ignore[no-untyped-call]  # unannotated in mlx-lm
    return type(c)(len(c.cache))


def _set_kv(out: Any, keys: list[mx.array], values: list[mx.array], offset: int) -> None:
    quantized = type(out) is mlx_cache.QuantizedKVCache
    out.keys = tuple(keys) if quantized else keys[0]
    out.values = tuple(values) if quantized else values[0]
    out.offset = offset


def stack(caches: Sequence[Sequence[Any]]) -> list[Any]:
    """One cache holding every row of `caches` (each a cache of one or more rows, all at
    the same offset), in order."""
    out: list[Any] = []
    for layers in zip(*caches, strict=True):
        first = layers[0]
        new = _like(first)
        if type(first) in KV_LAYERS:
            offset = int(first.offset)
            if any(int(c.offset) != offset for c in layers):
                raise ValueError("rows at different offsets cannot share a forward")
            if offset:
                keys = [mx.concatenate([_parts(c.keys)[i][..., :offset, :] for c in layers])
                        for i in range(len(_parts(first.keys)))]
                values = [mx.concatenate([_parts(c.values)[i][..., :offset, :] for c in layers])
                          for i in range(len(_parts(first.values)))]
                _set_kv(new, keys, values, offset)
        else:
            rows = [_arrays_rows(c) for c in layers]
            for i in range(len(first.cache)):
                got = [c.cache[i] for c in layers]
                if all(a is None for a in got):
                    continue
                like = next(a for a in got if a is not None)
                new.cache[i] = mx.concatenate([
                    a if a is not None else mx.zeros((n, *like.shape[1:]), like.dtype)
                    for a, n in zip(got, rows, strict=True)])
        out.append(new)
    return out


def _arrays_rows(c: Any) -> int:
    for a in c.cache:
        if a is not None:
            return int(a.shape[0])
    return 1


def keep(cache: Sequence[Any], indices: Sequence[int], end: int | None = None) -> list[Any]:
    """The rows `indices` of a stacked cache, in that order; their first `end` tokens
    (None: all)."""
    idx = mx.array(list(indices), dtype=mx.int32)
    out: list[Any] = []
    for c in cache:
        new = _like(c)
        if type(c) in KV_LAYERS:
            offset = int(c.offset) if end is None else min(end, int(c.offset))
            if offset:
                _set_kv(new, [p[idx, :, :offset] for p in _parts(c.keys)],
                        [p[idx, :, :offset] for p in _parts(c.values)], offset)
        else:
            new.cache = [a[idx] if a is not None else None for a in c.cache]
        out.append(new)
    return out


def take(cache: Sequence[Any], index: int, end: int | None = None) -> list[Any]:
    """Row `index` of a stacked cache as a single-row cache (its first `end` tokens)."""
    return keep(cache, [index], end)


def paddable(cache: Sequence[Any]) -> bool:
    """Every layer keeps its tokens by position, so a row's tokens past its own end can
    be cut off again (`take`'s `end`); a recurrent layer folds them into its state."""
    return all(type(c) in KV_LAYERS for c in cache)


def padded(ends: Sequence[int], limit: int, fit: tuple[float, float, float] | None,
           context: float) -> int:
    """Prompt tokens every row of a prefill group takes in one forward.  Row i has
    ends[i] tokens left before its last prompt token; `limit`: what the step may take
    otherwise (its time, the chunk grid, a cut or keep point, a group ahead).  Without
    padding the step stops at the nearest end, and every further distinct end costs a
    forward of its own: prompts of 110, 112 and 113 tokens prefill in three forwards,
    two of one or two tokens.  Taking m tokens instead, past the ends below m (those
    rows are fed filler after their prompt, which no token of theirs attends to, and
    their caches are cut back to their own), saves the forwards of every distinct end
    below m at the fit's fixed part each, and costs the filler tokens at the fit's
    per-token cost (attention over everything before them: at most `context` + m).
    The m of the largest saving, where one saves anything; the nearest end otherwise,
    or without a fit (nothing measured yet).  Pure."""
    n = min(limit, *ends) if ends else limit
    if fit is None or len(ends) < 2 or n <= 0:
        return n
    fixed, per, per_ctx = fit
    best, gain = n, 0.0
    for m in sorted({e for e in ends if n < e <= limit}):
        saved = len({e for e in ends if e < m})
        filler = sum(m - e for e in ends if e < m)
        g = saved * fixed - filler * (per + per_ctx * (context + m))
        if g > gain:
            best, gain = m, g
    return best


# A chat prompt ends with its answer's header (`<|im_start|>assistant\n`: three tokens
# with ChatML, four with Llama 3's), its last turn cut at the header's first token: at
# most this many tokens from the cut to the prompt's end.
TAIL_TOKENS = 4


def join_point(prompt_len: int, cuts: Sequence[int], chunk: int) -> int:
    """Where a row's prefill ends and it joins its lane: its last turn cut (`seatd.turns`)
    where at most TAIL_TOKENS prompt tokens run from it to the end and no chunk-grid
    boundary lies past it, else its last prompt token, which its first decode step
    feeds.  From there its lane's steps feed it the rest of its prompt a token a step,
    their outputs dropped until the last prompt token's.  A cohort of chats cut at every
    message start then ends its prefill at each row's last cut, which the group's padded
    forward takes in one (`padded`), where each row's few tokens past it took a forward
    of their own (on an H100, 16 chats prefilled in 34-37 forwards: 247-517 ms to all
    decoding against 25-99 ms for the same prompts uncut).  A rule of the prompt alone,
    warm or cold: every chunk boundary of the prompt is at or before the point (a
    resumed prefix ends at one), and the tokens after it take the same steps either
    way.  Pure."""
    end = prompt_len - 1
    last = max((c for c in cuts if 0 < c <= end), default=0)
    if last == 0 or last == end or end - last >= TAIL_TOKENS or end // chunk * chunk > last:
        return end
    return last


# A prefill step nobody keeps a pace for (a cohort's, `seatd.batch_policy.paced`) takes
# enough tokens that its fixed part is at most this share of it, within a chunk a row.
FIXED_SHARE = 0.1


def unpaced_tokens(fit: tuple[float, float, float] | None, rows: int, context: float,
                   chunk: int, floor: int) -> int:
    """Prompt tokens per row of a prefill step of `rows` rows that nobody keeps a pace
    for (`context`: tokens already in): a chunk's worth in all (chunk // rows), or more
    where the step's fixed part (reading every weight, launching every layer) would be
    over FIXED_SHARE of it at the fit's cost per token, up to a chunk a row.  On a CPU a
    token's own cost soon outweighs the fixed part, and a chunk in all is about what
    amortises it; on a GPU a small model's forward is launches, nearly all fixed:
    traced through the batching bench on an H100 (demo, 16 clients), a cohort of 13
    held-out chats took 39 tokens a row a step, 4-14 ms a step beside the first rows'
    decode steps, and the slot's rows joined over 90-430 ms.  Without a fit (nothing
    measured), a chunk in all.  Pure."""
    base = max(floor, chunk // max(1, rows))
    if fit is None:
        return base
    fixed, per, per_ctx = fit
    token = per + per_ctx * context  # seconds a prompt token, at this context
    if token <= 0:
        return chunk
    want = fixed * (1 / FIXED_SHARE - 1) / token  # tokens in all
    return max(base, min(chunk, math.ceil(want / max(1, rows))))


RIDE_ALPHA = 0.3  # weight of a riding step in `RideCost`'s moving average
RIDE_MAX = 512  # riding tokens in one step at most (a prefill chunk's)


class PrefillCost:
    """A prefill step's time as fixed + per token + per token and context token (each
    prompt token attends to the tokens before it), fitted over the last WINDOW steps
    and the last BIG_WINDOW steps of BIG_STEP tokens or more."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)
        self.big: deque[tuple[int, float, float]] = deque(maxlen=BIG_WINDOW)
        self._fit: tuple[float, float, float] | None = None  # of the steps as they are
        self._fitted = False

    def observe(self, tokens: int, context: float, seconds: float) -> None:
        """A step of `tokens` prompt tokens (all rows together) whose rows had `context`
        tokens before them on average."""
        if tokens > 0 and seconds >= 0:
            (self.big if tokens >= BIG_STEP else self.steps).append((tokens, context, seconds))
            self._fitted = False

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed s, s per token, s per token per context token), or None before any;
        fitted once per observation (a prefill step asks more than once)."""
        if not self._fitted:
            self._fit, self._fitted = fit_cost([*self.big, *self.steps]), True
        return self._fit

    def tokens_within(self, seconds: float, context: float, rows: int,
                      floor: int) -> int | None:
        """Prompt tokens per row one step of `rows` rows may take, their prompts `context`
        tokens in, so that it lasts about `seconds`; at least `floor`."""
        fit = self.fit()
        return None if fit is None else tokens_within(fit, seconds, context, rows, floor)


def tokens_within(fit: tuple[float, float, float], seconds: float, context: float,
                  rows: int, floor: int) -> int:
    """`PrefillCost.tokens_within` for a given fit (fixed, per token, per token and
    context token).  Pure."""
    fixed, per, per_ctx = fit
    # fixed + rows * T * (per + per_ctx * (context + T / 2)) = seconds, for T
    a = rows * per_ctx / 2
    b = rows * (per + per_ctx * context)
    c = fixed - seconds
    if c >= 0 or (a <= 0 and b <= 0):
        return floor
    t = -c / b if a <= 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return max(floor, int(t))


class RideCost:
    """What a joining prompt's tokens add to a decode step they ride
    (`seatd.rows_cache.Rider`): seconds per riding token, a moving average of what
    riding steps took beyond the rows' own cost over the tokens that rode them.  No
    per-token law is assumed: on this CPU a riding token's attention over a long
    prompt costs several times a prefill chunk's per-token figure, and riding has a
    fixed part of its own.  Steps sized by the average (`tokens_within`, rounded up)
    converge on the count whose fixed and per-token parts fill the time, since a
    fixed part spread over fewer tokens raises the average and over more lowers it."""

    def __init__(self) -> None:
        self.rate: float | None = None  # seconds per riding token; None: none measured

    def observe(self, tokens: int, seconds: float) -> None:
        """`tokens` rode a step, adding `seconds` to it."""
        if tokens <= 0 or seconds < 0:
            return
        rate = seconds / tokens
        self.rate = rate if self.rate is None \
            else (1 - RIDE_ALPHA) * self.rate + RIDE_ALPHA * rate

    def tokens_within(self, seconds: float) -> int | None:
        """Tokens that may ride one step, adding about `seconds`; None before any ride
        was measured."""
        if self.rate is None:
            return None
        if self.rate <= 0:
            return RIDE_MAX
        return min(RIDE_MAX, max(0, math.ceil(seconds / self.rate)))


def fit_cost(steps: Sequence[tuple[int, float, float]]) -> tuple[float, float, float] | None:
    """Least squares of seconds on (1, tokens, tokens * context) with every part
    non-negative: the best of the fits with a fixed part and one or both per-token
    parts.  Where none has (a step on a busy machine can take longer than a bigger
    one), every second counts per token: an over-estimate of a token's cost, so a step
    then takes fewer tokens, never more."""
    if not steps:
        return None
    y = np.array([s for _, _, s in steps])
    t = np.array([float(n) for n, _, _ in steps])
    ctx = np.array([c for _, c, _ in steps])
    columns = (np.ones_like(t), t, t * ctx)
    best: tuple[float, list[float]] | None = None
    for subset in ((0, 1, 2), (0, 1), (0, 2)):  # a fit through the origin could under-
        # estimate the small steps that matter most
        x = np.stack([columns[i] for i in subset], axis=1)
        if np.linalg.matrix_rank(x) < x.shape[1]:
            continue
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if (coef < 0).any():
            continue
        full = [0.0, 0.0, 0.0]
        for i, v in zip(subset, coef, strict=True):
            full[i] = float(v)
        if full[1] == 0 and full[2] == 0:
            continue
        residual = float(((x @ coef - y) ** 2).sum())
        if best is None or residual < best[0] - 1e-15:
            best = (residual, full)
    if best is None:
        return 0.0, float(y.sum() / t.sum()), 0.0
    fixed, per, per_ctx = best[1]
    return fixed, per, per_ctx

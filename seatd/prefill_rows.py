"""Joining rows prefilled together: their caches stacked into one batch of mlx-lm caches
at one offset, one forward for all of them, and split again as each row's prompt is in.

    stackable(cache)       every layer is a type this module can stack
    stack(caches)          caches at one offset (B rows each) -> one cache of all rows
    take(cache, index)     row `index` of a stacked cache, as a cache of its own
    keep(cache, indices)   the stacked cache of those rows only

Rows at one offset need no padding and no mask beyond mlx-lm's own causal one, so a
joining group is plain mlx-lm caches with a batch axis; the batch engine
(`seatd.batch`) prefills the group that is furthest behind first, so that rows arriving
later catch up with a group in progress and merge with it where their offsets meet.

On this machine a prefill forward of a few dozen tokens costs mostly its fixed part
(reading the weights, launching the layers), so several joining rows in one forward
cost little more than one.  `PrefillCost` is that measured cost, fixed plus per token,
and says how many prompt tokens a step may take within a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from seatd.recurrent import RollbackArraysCache

WINDOW = 32  # prefill steps the cost fit looks back on


def _kv_types() -> tuple[type, ...]:
    return (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def stackable(cache: Sequence[Any]) -> bool:
    """Every layer is mlx-lm's KV (plain or quantized) or recurrent arrays cache."""
    return all(type(c) in (*_kv_types(), mlx_cache.ArraysCache, RollbackArraysCache)
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
        if type(first) in _kv_types():
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


def keep(cache: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """The rows `indices` of a stacked cache, in that order."""
    idx = mx.array(list(indices), dtype=mx.int32)
    out: list[Any] = []
    for c in cache:
        new = _like(c)
        if type(c) in _kv_types():
            offset = int(c.offset)
            if offset:
                _set_kv(new, [p[idx, :, :offset] for p in _parts(c.keys)],
                        [p[idx, :, :offset] for p in _parts(c.values)], offset)
        else:
            new.cache = [a[idx] if a is not None else None for a in c.cache]
        out.append(new)
    return out


def take(cache: Sequence[Any], index: int) -> list[Any]:
    """Row `index` of a stacked cache as a single-row cache."""
    return keep(cache, [index])


class PrefillCost:
    """A prefill step's time as fixed + per token, fitted over the last WINDOW steps."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.steps.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step."""
        return fit_cost(list(self.steps))

    def tokens_within(self, seconds: float, floor: int) -> int | None:
        """Prompt tokens one step may take so that it lasts about `seconds`."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per = fit
        return max(floor, int((seconds - fixed) / per))


def fit_cost(steps: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares of seconds on tokens.  With one size seen, or a fit that makes no
    sense (a negative part), every second counts as per-token: an over-estimate of
    a token's cost, so a step takes fewer tokens, never more."""
    if not steps:
        return None
    n = len(steps)
    sx = sum(t for t, _ in steps)
    sy = sum(s for _, s in steps)
    mean_per = sy / sx
    mx_, my = sx / n, sy / n
    var = sum((t - mx_) ** 2 for t, _ in steps)
    if var <= 0:
        return 0.0, mean_per
    per = sum((t - mx_) * (s - my) for t, s in steps) / var
    fixed = my - per * mx_
    if per <= 0 or fixed < 0:
        return 0.0, mean_per
    return fixed, per

"""Rollback for recurrent layers, so hybrid models speculate like attention-only ones.

A gated-delta layer (qwen3_next's linear attention) keeps two arrays instead of a KV
cache: the last `kernel - 1` inputs of its causal convolution and a recurrent state of
shape (B, heads, Dv, Dk), float32.  Neither can be cut back after a verify forward fed
tokens that were then rejected.  So during a verify forward, and only then, each such
layer records what rolling back needs:

- the full input of its convolution (the stored rows followed by the block's rows):
  after the first `n` tokens of the block the convolution state is rows n .. n+kernel-2;
- the recurrent state after each token of the block, computed one token at a time by
  mlx-lm's own `gated_delta_update` (the state stays float32, as in mlx-lm's reference).

`RollbackArraysCache` keeps that record (the "trail") until the next forward and
implements the cache protocol's `trim(n)` by restoring the state of the last kept token,
so `mlx_lm.models.cache.trim_prompt_cache` rolls a hybrid cache back exactly as it trims
a KV cache: one protocol for every layer kind, one decode loop for every model.  Outside
a verify forward nothing is recorded and the cache is not trimmable, so the prompt cache
still treats it as exact-length state.

`enable(model)` switches this on for a loaded model and proves it on the model itself
before saying yes: a recorded block rolled back must equal, bit for bit, the state
mlx-lm's own padding path reaches for the kept tokens at the same batch shape
(`feed_kept`).  A model it cannot prove (another recurrent design, a future
mlx-lm whose layers record nothing) stays non-rollbackable, and speculation declines
with `cache_not_rollbackable`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx_lm.models import cache as mlx_cache

log = structlog.get_logger()

# Records of the verify forward in progress, in the order the layers append them.
_recording: ContextVar[list[Any] | None] = ContextVar("sanctum_recording", default=None)

ENABLED_ATTR = "_sanctum_rollback"
PATCHED_ATTR = "_sanctum_records_steps"


@contextmanager
def recording() -> Iterator[None]:
    """Record what a rollback needs while building the graph of one verify forward."""
    token = _recording.set([])
    try:
        yield
    finally:
        _recording.reset(token)


# mlx.nn's stubs do not name Conv1d; the class is there at run time.
_Conv1d: Any = getattr(nn, "Conv1d")  # noqa: B009


class RecordingConv1d(_Conv1d):  # type: ignore[misc]
    """The gated-delta layer's convolution, keeping its input while a verify is recorded."""

    def __call__(self, x: mx.array) -> mx.array:
        records = _recording.get()
        if records is not None:
            records.append(("conv_input", x))
        out: mx.array = super().__call__(x)
        return out


def _stepwise(update: Callable[..., tuple[mx.array, mx.array]]) -> Callable[..., Any]:
    """`gated_delta_update` that, while recording, runs one token at a time and keeps
    every intermediate state.  Unrecorded calls go straight to mlx-lm's function."""

    def gated_delta_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                           A_log: mx.array, dt_bias: mx.array,
                           state: mx.array | None = None, mask: mx.array | None = None,
                           **kwargs: Any) -> tuple[mx.array, mx.array]:
        records = _recording.get()
        if records is None:
            return update(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
        states: list[mx.array | None] = [state]
        outs = []
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            y, state = update(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step],
                              A_log, dt_bias, state,
                              None if mask is None else mask[:, step], **kwargs)
            outs.append(y)
            states.append(state)
        records.append(("states", states))
        assert state is not None
        return mx.concatenate(outs, axis=1), state

    setattr(gated_delta_update, PATCHED_ATTR, True)
    return gated_delta_update


class RollbackArraysCache(mlx_cache.ArraysCache):
    """A gated-delta layer's cache ([conv state, recurrent state]) that can roll back
    the last recorded forward."""

    def __init__(self, size: int = 2) -> None:
        super().__init__(size)
        self.trail: tuple[mx.array, list[mx.array | None]] | None = None

    def advance(self, N: int) -> None:
        super().advance(N)  # type: ignore[no-untyped-call]  # mlx-lm leaves it unannotated
        records = _recording.get()
        self.trail = None
        if records is None:
            return
        taken = dict(records)  # this layer's records: the layers before took theirs
        records.clear()
        conv, states = taken.get("conv_input"), taken.get("states")
        if conv is not None and states is not None and len(states) == N + 1:
            self.trail = (conv, states)

    def is_trimmable(self) -> bool:
        return self.trail is not None

    def trim(self, n: int) -> int:
        if self.trail is None:
            return 0
        conv, states = self.trail
        self.trail = None
        fed = len(states) - 1
        n = max(0, min(n, fed))
        if n == 0:
            return 0
        keep = fed - n
        window = conv.shape[1] - fed  # kernel - 1 stored rows
        store: list[Any] = self.cache  # mlx-lm's ArraysCache starts as [None] * size
        store[0] = mx.contiguous(conv[:, keep : keep + window, :])
        store[1] = states[keep]
        return n


def roll_back_rows(cache: Any, keeps: Sequence[int]) -> None:
    """A batch's recurrent layer after a recorded forward: row b keeps the first keeps[b]
    tokens it was fed (`seatd.rows_cache`).  Each row gets the state of its own last kept
    token, as `trim` gives a single row."""
    trail = getattr(cache, "trail", None)
    if trail is None:
        raise RuntimeError("a recurrent layer rolled back without a recorded forward")
    conv, states = trail
    cache.trail = None
    fed = len(states) - 1
    window = conv.shape[1] - fed
    keep = mx.array([max(0, min(int(k), fed)) for k in keeps], dtype=mx.int32)
    rows = mx.arange(len(keeps))
    at = (keep[:, None] + mx.arange(window)[None, :])[..., None]  # (B, window, 1)
    cache.cache[0] = mx.take_along_axis(conv, at, axis=1)
    known = next(s for s in states if s is not None)
    stacked = mx.stack([s if s is not None else mx.zeros_like(known) for s in states])
    cache.cache[1] = stacked[keep, rows]


def _linear_layers(model: Any) -> list[Any]:
    return [layer for layer in getattr(model, "layers", [])
            if getattr(layer, "is_linear", False) and hasattr(layer, "linear_attn")]


def _patch_module(model: Any) -> bool:
    """Route the model module's `gated_delta_update` through the stepwise recorder."""
    module = sys.modules.get(type(model.model).__module__ if hasattr(model, "model")
                             else type(model).__module__)
    update = getattr(module, "gated_delta_update", None)
    if module is None or update is None:
        return False
    if not getattr(update, PATCHED_ATTR, False):
        module.gated_delta_update = _stepwise(update)  # type: ignore[attr-defined]
    return True


def make_cache(model: Any, base: list[Any]) -> list[Any]:
    """`base` with each recurrent layer's cache made rollbackable, for enabled models."""
    if not getattr(model, ENABLED_ATTR, False):
        return base
    return [RollbackArraysCache(len(c.cache)) if type(c) is mlx_cache.ArraysCache else c
            for c in base]


def can_roll_back(cache: list[Any]) -> bool:
    """Every layer either trims (KV) or rolls back a recorded forward (recurrent)."""
    return bool(cache) and all(
        isinstance(c, RollbackArraysCache) or (not isinstance(c, mlx_cache.ArraysCache)
                                               and c.is_trimmable())
        for c in cache)


def state_arrays(cache: list[Any]) -> list[mx.array]:
    """Every array a cache holds for the tokens it has seen, in layer order (KV cut to
    its offset: rows past it are stale, never read)."""
    out: list[mx.array] = []
    for c in cache:
        if isinstance(c, mlx_cache.ArraysCache):
            arrays: list[Any] = c.cache
            out.extend(a for a in arrays if a is not None)
            continue
        keys, values = c.state[0], c.state[1]
        for part in (keys, values):
            for a in part if isinstance(part, (list, tuple)) else (part,):
                out.append(a[..., : c.offset, :])
    return out


def feed_kept(model: Any, cache: list[Any], block: mx.array, keep: int) -> None:
    """mlx-lm's own way to the state after the first `keep` tokens of `block` (1, T), at
    the same batch shape as a verify forward: recurrent layers treat the rest as right
    padding (`lengths`: masked steps leave the state alone), KV layers are trimmed.

    Rolling back a recorded forward must land exactly here; rounding differs between
    batch shapes, so this is the like-for-like reference."""
    fed = block.shape[1]
    for c in cache:
        if isinstance(c, mlx_cache.ArraysCache):
            held: Any = c  # mlx-lm types `lengths` by its first value, None
            held.lengths = mx.array([keep])
    model(block, cache=cache)
    for c in cache:
        if isinstance(c, mlx_cache.ArraysCache):
            c.lengths = None
        elif fed > keep:
            c.trim(fed - keep)


def same_state(a: list[Any], b: list[Any]) -> bool:
    """Bit-for-bit equality of two caches' states."""
    xs, ys = state_arrays(a), state_arrays(b)
    mx.eval(xs, ys)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
        for x, y in zip(xs, ys, strict=True))


def _proves_exact(model: Any) -> bool:
    """A recorded 4-token block rolled back to each shorter length lands on `feed_kept`."""
    prompt = mx.array([[5, 17, 42, 7, 99]], dtype=mx.uint32)
    block = mx.array([[3, 64, 11, 8]], dtype=mx.uint32)
    for keep in range(1, block.shape[1]):
        live = make_cache(model, model.make_cache())
        ref = make_cache(model, model.make_cache())
        for cache in (live, ref):
            model(prompt, cache=cache)
        with recording():
            model(block, cache=live)
        if not can_roll_back(live):
            return False
        trimmed: Any = mlx_cache.trim_prompt_cache(live, block.shape[1] - keep)  # a count
        if trimmed != block.shape[1] - keep:
            return False
        feed_kept(model, ref, block, keep)
        if not same_state(live, ref):
            return False
    return True


def enable(model: Any) -> bool:
    """Make a hybrid gated-delta model's recurrent caches rollbackable, if provably exact.

    Models without recurrent layers need nothing and return False; so does any model
    this cannot prove on (its caches stay mlx-lm's own)."""
    layers = _linear_layers(model)
    if not layers or not hasattr(model, "make_cache"):
        return False
    if not all(type(getattr(layer.linear_attn, "conv1d", None)) in (_Conv1d, RecordingConv1d)
               for layer in layers):  # a subclass would lose its own __call__
        return False
    if not _patch_module(model):
        return False
    for layer in layers:
        layer.linear_attn.conv1d.__class__ = RecordingConv1d
    setattr(model, ENABLED_ATTR, True)
    try:
        exact = _proves_exact(model)
    except Exception as exc:  # an unknown layout: stay non-rollbackable
        log.warning("recurrent_rollback_unproven", error=repr(exc))
        exact = False
    if not exact:
        setattr(model, ENABLED_ATTR, False)
    log.info("recurrent_rollback", enabled=exact, recurrent_layers=len(layers))
    return exact

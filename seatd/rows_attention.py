"""Attention over a batch whose rows' keys and values lie in several buffers.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values,
cache=, scale=, mask=)`, a name each model module imports from `mlx_lm.models.base`,
with the keys and values its cache's `update_and_fetch` returned.  A batch held in
segments (`seatd.kv_segments`) returns `Ragged` keys and values: each segment's rows and
the view of its buffer from its own first column.  `install(model)` rebinds that name,
in the modules the model's layers come from, to `attention`, which runs mlx-lm's own
function once per segment (the quantized path included) on the segment's rows, its
columns of the mask, and its buffer, and stacks the rows again; a joining prompt's rows
riding the step (`seatd.rows_cache.Rider`) are folded back into one row of their tokens
in order and attend causally to the prompt's own cache.  Anything else passes straight
through, so requests alone and mlx-lm's own caches are untouched.

Rebinding a library's name is a patch; it is the one hook mlx-lm offers between a
cache and its attention.  A model whose layers do more with the keys than hand them on
(a new architecture) is caught by `RowsCache.for_model`'s probe, and its batch keeps
one buffer (`seatd.rows_cache`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

_LIBRARY = base.scaled_dot_product_attention
NAME = "scaled_dot_product_attention"


@dataclass(frozen=True)
class Ragged:
    """Keys (or values) of a batch in segments: (first row, end row, first column, the
    buffer's view from that column to the step's last), in row order; and a prompt
    riding the step (`seatd.rows_cache.Rider`): its rows (the batch's last, from
    `rider_from`) and its own cache's keys (or values) up to its last token, with that
    cache (whose `bits` say which attention mlx-lm takes)."""

    segs: tuple[tuple[int, int, int, Any], ...]
    rider_from: int = -1
    rider: Any = None
    rider_cache: Any = None


def fold(x: mx.array) -> mx.array:
    """A rider's rows (j, H, n, D) as one row of its j * n tokens in order (1, H, j*n, D)."""
    j, h, n, d = x.shape
    return x.transpose(1, 0, 2, 3).reshape(1, h, j * n, d)


def unfold(x: mx.array, j: int) -> mx.array:
    """`fold` undone: (1, H, j*n, D) back to (j, H, n, D)."""
    _, h, m, d = x.shape
    return x.reshape(h, j, m // j, d).transpose(1, 0, 2, 3)


def attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
              mask: Any, sinks: Any = None) -> mx.array:
    """mlx-lm's attention, segment by segment where the keys are `Ragged`."""
    if not isinstance(keys, Ragged):
        return _LIBRARY(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks)
    if not isinstance(values, Ragged) or len(values.segs) != len(keys.segs):
        raise TypeError("ragged keys need ragged values of the same segments")
    outs = []
    for (a, b, col, k), (_, _, _, v) in zip(keys.segs, values.segs, strict=True):
        m = mask[a:b, ..., col:] if isinstance(mask, mx.array) else mask
        outs.append(_LIBRARY(queries[a:b], k, v, cache=cache, scale=scale, mask=m,
                             sinks=sinks))
    if keys.rider_from >= 0:  # the riding prompt's tokens, causal over its own cache
        q = queries[keys.rider_from:]
        out = _LIBRARY(fold(q), keys.rider, values.rider, cache=keys.rider_cache,
                       scale=scale, mask="causal",  # type: ignore[arg-type]  # mlx-lm passes
                       sinks=sinks)  # "causal" itself; its annotation says arrays only
        outs.append(unfold(out, q.shape[0]))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def install(model: Any) -> bool:
    """Route the attention of the model's modules through `attention`; whether any
    module of the model calls it (none: the model's layers cannot take `Ragged`)."""
    names = {type(model).__module__}
    modules = getattr(model, "modules", None)
    if callable(modules):
        names.update(type(m).__module__ for m in modules())
    found = False
    for name in names:
        module = sys.modules.get(name)
        bound = getattr(module, NAME, None)
        if bound is attention:
            found = True
        elif bound is _LIBRARY:
            setattr(module, NAME, attention)
            found = True
    return found

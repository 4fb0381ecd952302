"""Dtype discipline: no layer may change the residual stream's dtype, and recurrent
state stays float32.

Two failures hide in hybrid models: a kernel returning float32 where its input was
bfloat16 (every later layer then runs in float32, doubling activation bytes on a
bandwidth-bound machine), and a shortcut keeping recurrent state in bfloat16 where
mlx-lm's reference keeps float32 (rounding that dozens of layers amplify until greedy
argmaxes flip).  `leaks(model, ...)` runs one forward with every layer watched and
names each offence; the seat logs them at load and tests assert there are none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

STATE_DTYPE = mx.float32


def leaks(model: Any, cache: list[Any], tokens: Sequence[int]) -> list[str]:
    """Feed `tokens` through `model` with `cache`; list every dtype offence."""
    found: list[str] = []
    originals = []
    for i, layer in enumerate(model.layers):
        cls = type(layer)

        def watched(self: Any, x: mx.array, *args: Any, _i: int = i, _cls: type = cls,
                    **kwargs: Any) -> mx.array:
            out: mx.array = _cls.__call__(self, x, *args, **kwargs)
            if isinstance(out, mx.array) and out.dtype != x.dtype:
                found.append(f"layer {_i} ({_cls.__name__}): {x.dtype} in, {out.dtype} out")
            return out

        originals.append(cls)
        layer.__class__ = type(f"Watched{cls.__name__}", (cls,), {"__call__": watched})
    try:
        model(mx.array(list(tokens), dtype=mx.uint32)[None], cache=cache)
    finally:
        for layer, cls in zip(model.layers, originals, strict=True):
            layer.__class__ = cls
    for i, (layer, c) in enumerate(zip(model.layers, cache, strict=False)):
        if not hasattr(layer, "linear_attn") or not isinstance(c, mlx_cache.ArraysCache):
            continue  # only gated-delta layers have a float32 reference state
        if c.cache[1] is not None:
            if c.cache[1].dtype != STATE_DTYPE:
                found.append(f"layer {i} recurrent state: {c.cache[1].dtype}, not float32")
    return found

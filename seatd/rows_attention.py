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

`library` is mlx-lm's attention as each backend computes it exactly.  On the CPU and on
Metal it is mlx-lm's function itself.  On CUDA (MLX 0.32, measured on an H200):
- a fused attention over more than one query builds a cuDNN graph for every new shape:
  50-70 ms the first time a key length is seen, 0.08 ms after.  A verify step's key
  length is new every round, so a depth-1 round took 23-47 ms against a 1.4 ms plain
  step.  And the one-query kernel (`sdpa_vector`) rounds otherwise than the multi-query
  path: a token verified in a block differed in its logits (0.125 at bfloat16) from the
  same token stepped plainly, which flipped seeded answers.  So a block of up to
  `SPLIT_QUERIES` queries runs as that many one-query attentions, each over its own causal
  prefix of the keys: the plain step's own kernel at the plain step's own shapes, so a
  verified token's attention is bit for bit the plain step's;
- a wider block (a prefill chunk) is composed of matmuls and a softmax (no per-shape
  graph) while its scores stay under `COMPOSED_SCORES`, else takes the fused kernel;
- the 8-bit quantized matmul has no kernel for attention's batched shapes ("No
  implementation for problem shape"), so a q8 cache's keys and values are dequantized
  (its own group size and bits) and the float path above takes them;
- one query a row (a plain step, alone or batched, masked or not, and each query of a
  split block) takes `seatd.rows_kernel`'s one-query kernel where it applies: under a
  batch's mask not MLX's composed fallback (one kernel against five and their copies:
  the step is host-bound there), and without one not cuDNN, which MLX picks for keys
  from 256 on and which builds a graph at every new buffer size and batch (by MLX's
  source; likely some of `seatd.warm_shapes`' 45-110 ms first rounds at each new
  capacity, not traced), and whose dispatch took 96 us against the kernel's 43 at
  1,024 keys (`seatd.rows_kernel`).  A plain step and a
  split block's query still take one path at one length, so a verified token's
  attention stays the plain step's.  The kernel is checked once a process against
  the composed path (`kernel_ready`); one that fails to build or to agree is not used.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models import base

from seatd import rows_kernel
from seatd.backend import backend

log = structlog.get_logger()

_LIBRARY = base.scaled_dot_product_attention
NAME = "scaled_dot_product_attention"
SPLIT_QUERIES = 16  # on CUDA a block this narrow attends query by query
COMPOSED_SCORES = 1 << 26  # on CUDA a wider block is composed while B*H*n*S stays under this
CUDA_RULE = f"split{SPLIT_QUERIES}-composed-onequery-v2"  # in a CUDA seat's fingerprint


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
        return library(queries, keys, values, cache, scale, mask, sinks)
    if not isinstance(values, Ragged) or len(values.segs) != len(keys.segs):
        raise TypeError("ragged keys need ragged values of the same segments")
    outs = []
    for (a, b, col, k), (_, _, _, v) in zip(keys.segs, values.segs, strict=True):
        m = mask[a:b, ..., col:] if isinstance(mask, mx.array) else mask
        outs.append(library(queries[a:b], k, v, cache, scale, m, sinks))
    if keys.rider_from >= 0:  # the riding prompt's tokens, causal over its own cache
        q = queries[keys.rider_from:]
        out = library(fold(q), keys.rider, values.rider, keys.rider_cache, scale, "causal",
                      sinks)
        outs.append(unfold(out, q.shape[0]))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def library(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
            mask: Any, sinks: Any = None, on: str | None = None) -> mx.array:
    """mlx-lm's attention, as the backend `on` (default: this process's) computes it
    exactly (see the module's docstring)."""
    if (on or backend()) != "cuda":
        return _LIBRARY(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks)
    if hasattr(cache, "bits"):  # no 8-bit quantized matmul of these shapes here
        keys, values = (mx.dequantize(w, scales, biases, group_size=cache.group_size,
                                      bits=cache.bits) for w, scales, biases in (keys, values))
        cache = None
    n = queries.shape[2]
    causal = isinstance(mask, mx.array) or mask == "causal"
    if n == 1 or not causal:
        return _one_query(queries, keys, values, cache, scale, mask, sinks)
    if n <= SPLIT_QUERIES:
        outs = []
        for i in range(n):
            k, v, m = _prefix(keys, values, mask, n, i)
            outs.append(_one_query(queries[:, :, i : i + 1], k, v, cache, scale, m, sinks))
        return mx.concatenate(outs, axis=2)
    if sinks is None and queries.shape[0] * queries.shape[1] * n * keys.shape[2] \
            <= COMPOSED_SCORES:
        return composed(queries, keys, values, scale, mask)
    return _LIBRARY(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _one_query(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
               scale: float, mask: Any, sinks: Any) -> mx.array:
    """One query a row on CUDA (or a block that is not causal): the module's kernel
    where it applies, else mlx-lm's function."""
    if queries.shape[2] == 1 and sinks is None \
            and rows_kernel.usable(queries, keys, values, mask) and kernel_ready():
        return rows_kernel.attention(queries, keys, values, scale, mask)
    return _LIBRARY(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


_kernel_state: dict[str, bool] = {}  # "ready": the one-query kernel built and agreed


def kernel_ready() -> bool:
    """Whether `seatd.rows_kernel`'s one-query kernel builds on this device and agrees
    with the composed path (2% of the largest output, 16-bit) on a small batch of rows
    of different lengths and grouped heads, masked and not; decided once a process.  A
    kernel that cannot (no compiler, a driver that refuses it, a wrong answer) leaves
    mlx-lm's function in its place and says so in the log: a fast path declines, it
    never fails a step."""
    ready = _kernel_state.get("ready")
    if ready is None:
        ready = _check_kernel()
        _kernel_state["ready"] = ready
    return ready


def _check_kernel() -> bool:
    try:
        B, H, kv, S, D = 3, 4, 2, 40, 64
        keys = mx.random.split(mx.random.key(7), 3)
        q, k, v = (mx.random.normal((B, h, n, D), key=keys[i]).astype(mx.bfloat16)
                   for i, (h, n) in enumerate(((H, 1), (kv, S), (kv, S))))
        cols = mx.arange(S)[None, :]
        mask = ((cols >= mx.array([[0], [9], [33]])) & (cols != 20))[:, None, None, :]
        for m in (mask, None):
            got = rows_kernel.attention(q, k, v, 0.125, m).astype(mx.float32)
            want = composed(q, k, v, 0.125, m).astype(mx.float32)
            gap = mx.abs(got - want).max()
            if not bool((gap <= 2e-2 * mx.maximum(mx.abs(want).max(), 1.0)).item()):
                log.warning("rows_kernel_disagrees", gap=gap.item(), masked=m is not None)
                return False
        return True
    except Exception as exc:  # no NVRTC, a refused build: mlx-lm's function stays
        log.warning("rows_kernel_unavailable", error=repr(exc))
        return False


def _prefix(keys: mx.array, values: mx.array, mask: Any, n: int, i: int
            ) -> tuple[mx.array, mx.array, Any]:
    """Query i of a causal block of n: the keys and values up to its own position, and
    its row of the mask over them (every multi-query mask of mlx-lm's and of the rows
    cache is causal: query i sees no column past the block's i-th)."""
    end = keys.shape[2] - n + i + 1
    m: Any = None  # "causal": its prefix is all it sees
    if isinstance(mask, mx.array):
        m = mask[..., i : i + 1, :end] if mask.shape[-2] == n else mask[..., :end]
    return keys[:, :, :end], values[:, :, :end], m


def composed(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
             mask: Any) -> mx.array:
    """Attention as matmuls and a precise softmax, heads grouped by their key head as
    mlx-lm's quantized attention groups them; `mask` "causal", None, boolean or additive."""
    B, H, n, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(B, kv_heads, H // kv_heads, n, D)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # (B, kv heads, repeats, n, S)
    if isinstance(mask, str):
        mask = mx.arange(S - n, S)[:, None] >= mx.arange(S)[None]
    if isinstance(mask, mx.array):
        if mask.ndim == 4:  # (B, heads or 1, n or 1, S): a repeats axis beside the heads
            mask = (mx.expand_dims(mask, 2) if mask.shape[1] == 1
                    else mask.reshape(mask.shape[0], kv_heads, H // kv_heads, *mask.shape[2:]))
        scores = (mx.where(mask, scores, mx.finfo(scores.dtype).min)
                  if mask.dtype == mx.bool_ else scores + mask)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(values, 2)).reshape(B, H, n, D)


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

"""The cache of a batch of rows: every row's KV in shared columns, each row its own.

One batched forward feeds every row `n` tokens (the same `n`: a row with fewer real
tokens is padded).  Attention layers write all rows at one shared column, as mlx-lm's
`BatchKVCache` does; unlike it, each row keeps its own validity per column and its own
position.  That is what a batch that speculates needs: after a verify, each row keeps
a different number of its tokens, and the rejected ones simply become invalid columns
(`roll_back`), where `BatchKVCache` can only trim every row by the same count.  Padding
(a row joined with a shorter history, a row not drafting in a verify step) is invalid
columns too.  Columns invalid for every row at either end are reclaimed; holes inside
are squeezed out (`compact`) when they grow past `SLACK` columns.

    batch = RowsCache.for_model(model, kv)     empty; raises Unbatchable for other caches
    batch.join(row_cache, length)              a prefilled single-row cache becomes a row
    batch.begin(counts, n) / forward / batch.end()   one step; counts = real tokens per row
    batch.roll_back(keeps)                     after a verify: each row keeps its first keeps[b]
    batch.drop(keep)                           rows that finished leave

Recurrent layers (a hybrid model's gated-delta state) are mlx-lm's `ArraysCache` with B
rows: padding is masked with its `lengths`, and rolling back restores each row's own
recorded state (`seatd.recurrent.roll_back_rows`).

The host keeps the layout (validity and positions, numpy) and hands the forward a
boolean mask (B, 1, n, columns), or mlx-lm's own mask where no column is padding or a
hole, and per-row positions for RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent
from seatd.decode import make_cache

log = structlog.get_logger()

STEP = 256  # columns are allocated in steps of this many
SLACK = 256  # holes tolerated before a compaction


class Unbatchable(Exception):
    """The model has a layer cache this batch cannot hold (sliding windows, ...)."""


def _grow(parts: list[mx.array], need: int) -> list[mx.array]:
    cap = parts[0].shape[2]
    if need <= cap:
        return parts
    extra = -(-(need - cap) // STEP) * STEP
    return [mx.concatenate([p, mx.zeros((*p.shape[:2], extra, p.shape[3]), p.dtype)], axis=2)
            for p in parts]


class RowsKV:
    """One attention layer of the batch: keys and values of every row, (B, H, cap, D)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None

    # -- mlx-lm's cache protocol, as the attention layers call it --------------

    @property
    def offset(self) -> mx.array:
        return self.layout.positions

    def _pack(self, x: mx.array) -> list[mx.array]:
        return [x]

    def _view(self, parts: list[mx.array], end: int) -> Any:
        return parts[0][..., :end, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        start, n = self.layout.idx, keys.shape[2]
        k, v = self._pack(keys), self._pack(values)
        if self.keys is None or self.values is None:
            cap = -(-(start + n) // STEP) * STEP
            self.keys = [mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype) for p in k]
            self.values = [mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype) for p in v]
        self.keys, self.values = _grow(self.keys, start + n), _grow(self.values, start + n)
        for buf, new in zip(self.keys, k, strict=True):
            buf[..., start : start + n, :] = new
        for buf, new in zip(self.values, v, strict=True):
            buf[..., start : start + n, :] = new
        return self._view(self.keys, start + n), self._view(self.values, start + n)

    def make_mask(self, N: int, return_array: bool = False, **_: Any) -> mx.array | str | None:
        return self.layout.mask(N)

    @property
    def state(self) -> list[mx.array]:
        return [*(self.keys or []), *(self.values or [])]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.state)

    def is_trimmable(self) -> bool:
        return False  # rows roll back one by one (`RowsCache.roll_back`), never all at once

    # -- structure, driven by RowsCache ---------------------------------------

    def map(self, f: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = [f(p) for p in self.keys]
            self.values = [f(p) for p in self.values]

    def add_row(self, layer: Any, length: int, shift: int, cap: int, rows: int,
                used: int) -> None:
        """One more row, last: the `rows` rows there move `shift` columns right (their
        first `used` columns are all they hold) and the new row's first `length` tokens
        end at the new write column, in buffers of `cap` columns.  Each part is written
        once, into one new buffer: a long row joining short ones copies every row's KV
        once, not once per pad and once per concatenation."""
        if layer.keys is None:  # a row with no tokens yet: all padding
            src_k: list[mx.array] | None = None
            src_v: list[mx.array] | None = None
        else:
            src_k = list(layer.keys) if isinstance(layer.keys, (list, tuple)) else [layer.keys]
            src_v = (list(layer.values) if isinstance(layer.values, (list, tuple))
                     else [layer.values])
        idx = used + shift
        self.keys = _joined(self.keys if rows else None, src_k, rows, shift, used, idx,
                            length, cap)
        self.values = _joined(self.values if rows else None, src_v, rows, shift, used, idx,
                              length, cap)


def _joined(have: list[mx.array] | None, new: list[mx.array] | None, rows: int, shift: int,
            used: int, idx: int, length: int, cap: int) -> list[mx.array] | None:
    """Buffers of rows + 1 rows and `cap` columns, zero but for the old rows' first
    `used` columns (moved `shift` right) and the new row's `length` tokens, ending at
    column `idx`.  None while no row has KV."""
    shapes = have if have is not None else new
    if shapes is None:
        return None
    out: list[mx.array] = []
    for i, ref in enumerate(shapes):
        buf = mx.zeros((rows + 1, ref.shape[1], cap, ref.shape[3]), ref.dtype)
        if have is not None and used:
            buf[:rows, :, shift:idx, :] = have[i][..., :used, :]
        if new is not None and length:
            buf[rows:, :, idx - length : idx, :] = new[i][..., :length, :]
        out.append(buf)
    return out


class RowsQuantizedKV(RowsKV):
    """The q8 lane: keys and values quantized along the feature axis, as mlx-lm's
    `QuantizedKVCache` stores them (so attention takes the quantized path)."""

    def __init__(self, layout: Layout, group_size: int, bits: int) -> None:
        super().__init__(layout)
        self.group_size = group_size
        self.bits = bits

    def _pack(self, x: mx.array) -> list[mx.array]:
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _view(self, parts: list[mx.array], end: int) -> Any:
        return tuple(p[..., :end, :] for p in parts)


class Layout:
    """Which columns hold which row's tokens; the attention layers' shared view."""

    def __init__(self) -> None:
        self.idx = 0  # the next write column, the same for every row
        self.valid = np.zeros((0, 0), dtype=bool)  # (B, idx): column holds a live token
        self.pos = np.zeros((0,), dtype=np.int64)  # (B,): position of each row's next token
        self.positions = mx.zeros((0,), dtype=mx.int32)
        self._step: np.ndarray | None = None  # (B, n) real tokens of the step in flight
        self._n = 0
        self._mask: mx.array | str | None = None

    @property
    def rows(self) -> int:
        return int(self.valid.shape[0])

    def begin(self, counts: Sequence[int], n: int) -> None:
        step = np.arange(n)[None, :] < np.asarray(counts, dtype=np.int64)[:, None]
        self._step, self._n = step, n
        self.positions = mx.array(self.pos.astype(np.int32))
        if self.valid.all() and step.all():
            # No padding, no holes: mlx-lm's own masks (none for one token, "causal"
            # otherwise), so a row alone computes exactly what a request alone does.
            self._mask = None if n == 1 else "causal"
            return
        after = np.concatenate([self.valid, step], axis=1)  # (B, idx + n)
        causal = np.arange(self.idx + n)[None, :] <= (self.idx + np.arange(n))[:, None]
        self._mask = mx.array(after[:, None, None, :] & causal[None, None])

    def mask(self, n: int) -> mx.array | str | None:
        assert self._step is not None and self._n == n, "begin() the step first"
        return self._mask

    def end(self) -> None:
        assert self._step is not None
        step = self._step
        self.valid = np.concatenate([self.valid, step], axis=1)
        self.pos = self.pos + step.sum(axis=1)
        self.idx += step.shape[1]
        self._step, self._mask = None, None


class RowsCache:
    """Every layer's cache for the rows of one batch, in the model's layer order."""

    capacity: int | None = None  # rows it can hold: any number

    def __init__(self, layers: list[Any], layout: Layout) -> None:
        self.layers = layers
        self.layout = layout

    @classmethod
    def for_model(cls, model: Any, kv: str) -> RowsCache:
        template = make_cache(model, kv)
        layout = Layout()
        layers: list[Any] = []
        for c in template:
            if type(c) is mlx_cache.KVCache:
                layers.append(RowsKV(layout))
            elif type(c) is mlx_cache.QuantizedKVCache:
                layers.append(RowsQuantizedKV(layout, c.group_size, c.bits))
            elif isinstance(c, mlx_cache.ArraysCache):
                layers.append(type(c)(len(c.cache)))
            else:
                raise Unbatchable(f"{type(c).__name__} layers are not batched")
        return cls(layers, layout)

    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def kv_layers(self) -> list[RowsKV]:
        return [c for c in self.layers if isinstance(c, RowsKV)]

    @property
    def recurrent_layers(self) -> list[Any]:
        return [c for c in self.layers if isinstance(c, mlx_cache.ArraysCache)]

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in self.kv_layers)
        for c in self.recurrent_layers:
            total += sum(int(a.nbytes) for a in c.cache if a is not None)
        return total

    @property
    def state(self) -> list[mx.array]:
        out: list[mx.array] = []
        for c in self.layers:
            if isinstance(c, RowsKV):
                out.extend(c.state)
            else:
                out.extend(a for a in c.cache if a is not None)
        return out

    # -- steps ----------------------------------------------------------------

    def begin(self, counts: Sequence[int], n: int) -> None:
        """Before a forward of `n` tokens per row, of which counts[b] are row b's own."""
        self.layout.begin(counts, n)
        ragged = any(c != n for c in counts)
        for c in self.recurrent_layers:
            c.lengths = mx.array(list(counts), dtype=mx.int32) if ragged else None

    def end(self) -> None:
        self.layout.end()
        for c in self.recurrent_layers:
            c.lengths = None

    def roll_back(self, keeps: Sequence[int], n: int) -> None:
        """After a step of `n` tokens per row: row b keeps the first keeps[b] of them.
        Recurrent layers need the step recorded (`seatd.recurrent.recording`)."""
        lay = self.layout
        first = lay.idx - n
        for b, keep in enumerate(keeps):
            live = lay.valid[b, first + keep : lay.idx]
            lay.pos[b] -= int(live.sum())
            lay.valid[b, first + keep : lay.idx] = False
        for c in self.recurrent_layers:
            recurrent.roll_back_rows(c, keeps)
        self._reclaim_tail()

    def _reclaim_tail(self) -> None:
        lay = self.layout
        used = lay.valid.any(axis=0)
        last = int(np.nonzero(used)[0][-1]) + 1 if used.any() else 0
        if last < lay.idx:
            lay.valid = lay.valid[:, :last]
            lay.idx = last

    # -- rows joining and leaving ---------------------------------------------

    def join(self, row: list[Any], length: int) -> None:
        """Append a prefilled single-row cache (of this lane's layer types) holding
        `length` tokens; its next token is at position `length`.  A row longer than
        the batch's columns left-pads everyone else to make room."""
        lay = self.layout
        shift = max(0, length - lay.idx)
        used, idx = lay.idx, lay.idx + shift
        # Room for the columns in use and the next steps', never less than a buffer has.
        cap = max([c.keys[0].shape[2] for c in self.kv_layers if c.keys is not None]
                  + [-(-(idx + 1) // STEP) * STEP])
        for mine, theirs in zip(self.layers, row, strict=True):
            if isinstance(mine, RowsKV):
                mine.add_row(theirs, length, shift, cap, lay.rows, used)
            else:
                _add_arrays_row(mine, theirs, lay.rows)
        valid = np.zeros((1, idx), dtype=bool)
        valid[0, idx - length :] = True
        if lay.rows:
            padded = np.concatenate([np.zeros((lay.rows, shift), dtype=bool), lay.valid],
                                    axis=1)
            lay.valid = np.concatenate([padded, valid])
        else:
            lay.valid = valid
        lay.idx = idx
        lay.pos = np.concatenate([lay.pos, np.array([length], dtype=np.int64)])

    def drop(self, keep: Sequence[int]) -> None:
        """Keep only the rows at these indices, in this order."""
        lay = self.layout
        if not keep:
            self._reset()
            return
        index = mx.array(list(keep), dtype=mx.int32)
        lay.valid = lay.valid[list(keep)]
        lay.pos = lay.pos[list(keep)]
        used = lay.valid.any(axis=0)
        lead = int(np.argmax(used)) if used.any() else lay.idx
        # The columns no row left uses are cut before the rows are gathered: a long row
        # leaving short ones copies only their columns, not the width it had made.
        for c in self.kv_layers:
            c.map(lambda p: p[..., lead:, :][index])
        for c in self.recurrent_layers:
            c.cache = [a[index] if a is not None else None for a in c.cache]
        if lead:
            lay.valid = lay.valid[:, lead:]
            lay.idx -= lead
        self._reclaim_tail()

    def _reset(self) -> None:
        """No rows left: fresh, empty layers (buffers go back to the allocator)."""
        layout = Layout()
        fresh: list[Any] = []
        for c in self.layers:
            if isinstance(c, RowsQuantizedKV):
                fresh.append(RowsQuantizedKV(layout, c.group_size, c.bits))
            elif isinstance(c, RowsKV):
                fresh.append(RowsKV(layout))
            else:
                fresh.append(type(c)(len(c.cache)))
        self.layers, self.layout = fresh, layout

    def holes(self) -> int:
        lay = self.layout
        if not lay.rows:
            return 0
        return lay.idx - int(lay.valid.sum(axis=1).max())

    def compact(self) -> None:
        """Squeeze every row's live columns together, right-aligned at the write column."""
        lay = self.layout
        if not lay.rows:
            return
        width = int(lay.valid.sum(axis=1).max())
        gather = np.zeros((lay.rows, width), dtype=np.int32)
        valid = np.zeros((lay.rows, width), dtype=bool)
        for b in range(lay.rows):
            cols = np.nonzero(lay.valid[b])[0]
            gather[b, width - len(cols):] = cols
            valid[b, width - len(cols):] = True
        index = mx.array(gather)[:, None, :, None]
        for c in self.kv_layers:
            c.map(lambda p: mx.take_along_axis(p[..., : lay.idx, :], index, axis=2))
        lay.valid, lay.idx = valid, width


def _add_arrays_row(mine: Any, theirs: Any, rows: int) -> None:
    """Append one row's recurrent arrays to the batch's (zeros for missing ones)."""
    for i, a in enumerate(theirs.cache):
        have = mine.cache[i]
        if a is None and have is None:
            continue
        if a is None:
            a = mx.zeros((1, *have.shape[1:]), have.dtype)
        if have is None:
            have = mx.zeros((rows, *a.shape[1:]), a.dtype)
        mine.cache[i] = mx.concatenate([have, a]) if rows else a


class OneRow:
    """The fallback for a model whose caches cannot be batched (`Unbatchable`): one row
    at a time, in mlx-lm's own single-row cache, behind the same interface.  Rolling
    back trims it, as a request alone does."""

    capacity = 1

    def __init__(self, model: Any, kv: str) -> None:
        self.model = model
        self.kv = kv
        self.layers: list[Any] = []

    @property
    def rows(self) -> int:
        return 1 if self.layers else 0

    @property
    def recurrent_layers(self) -> list[Any]:
        return [c for c in self.layers if isinstance(c, mlx_cache.ArraysCache)]

    @property
    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            try:
                total += int(c.nbytes)
            except Exception:  # an empty layer cannot say
                continue
        return total

    def begin(self, counts: Sequence[int], n: int) -> None:
        assert len(counts) == 1 and counts[0] == n

    def end(self) -> None:
        pass

    def roll_back(self, keeps: Sequence[int], n: int) -> None:
        drop = n - keeps[0]
        trimmed: Any = mlx_cache.trim_prompt_cache(self.layers, drop) if drop else 0
        if trimmed != drop:  # (mlx-lm annotates the count it returns as a list)
            raise RuntimeError(f"rollback of {drop} tokens failed")

    def holes(self) -> int:
        return 0

    def compact(self) -> None:
        pass

    def join(self, row: list[Any], length: int) -> None:
        assert not self.layers, "one row at a time"
        self.layers = row

    def drop(self, keep: Sequence[int]) -> None:
        if not keep:
            self.layers = []


def lane_cache(model: Any, kv: str) -> RowsCache | OneRow:
    """The batch cache of a lane, or one row at a time where the model cannot batch."""
    try:
        return RowsCache.for_model(model, kv)
    except Unbatchable as exc:
        log.warning("lane_not_batched", kv=kv, reason=str(exc))
        return OneRow(model, kv)

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
    batch.begin(counts, n, Rider(cache, offset, rows))   a joining prompt rides the step

A joining prompt's next tokens may ride a step (`Rider`): `rows` extra rows of the step's
`n` tokens after the batch's, at their own positions, whose keys and values go to the
prompt's own single-row cache and attend to it causally (`seatd.rows_attention`), as a
prefill forward of its own would compute them, with the weights read once for both.

The rows' keys and values lie in segments (`seatd.kv_segments`): consecutive rows with a
buffer of their own, which begins at the segment's first column.  A joining row's
prefilled buffer becomes a segment as it is, so joining copies nothing, and a long row
beside short ones neither moves their KV nor widens their attention
(`seatd.rows_attention`).  Segments whose rows are alike in length are merged, once,
before the next step.  The first batch of a model probes it (`_probe`: two rows of
different lengths, one step, each against itself alone): a model whose layers cannot
attend segment by segment keeps one segment (every join then copies the rows into one
buffer), and one whose rows batched do not decode as they do alone is `Unbatchable`
(its lane takes one row at a time, `OneRow`); a model that attends by segment is also
probed with a prompt riding (`_rides`), and takes riders only where that prompt then
decodes as it does prefilled alone.

Recurrent layers (a hybrid model's gated-delta state) are mlx-lm's `ArraysCache` with B
rows: padding is masked with its `lengths`, and rolling back restores each row's own
recorded state (`seatd.recurrent.roll_back_rows`).

The host keeps the layout (validity and positions, numpy) and hands the forward a
boolean mask (B, 1, n, columns), or mlx-lm's own mask where no column is padding or a
hole, and per-row positions for RoPE.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent, rows_attention
from seatd.backend import backend
from seatd.engine_types import make_cache
from seatd.kv_segments import merge_runs, segment_cost
from seatd.prefill_rows import KV_LAYERS
from seatd.rows_attention import Ragged, fold

log = structlog.get_logger()

STEP = 256  # columns are allocated in steps of this many
SLACK = 256  # holes tolerated before a compaction

Parts = list[mx.array]  # one buffer: [keys] or a quantized one's [data, scales, biases]


class Unbatchable(Exception):
    """The model has a layer cache this batch cannot hold (sliding windows, ...), or its
    rows batched do not decode as they do alone (`_probe`)."""


@dataclass
class Seg:
    """Consecutive rows with one buffer per layer, whose column 0 is the batch's
    column `col`."""

    rows: int
    col: int


@dataclass
class Rider:
    """A joining prompt's next tokens carried by a batch step (`RowsCache.begin`):
    `rows` rows of the step's n tokens each, placed after the batch's rows, at positions
    from `offset`; their keys and values go to the prompt's own single-row cache
    (`layers`, mlx-lm's KV caches in the model's layer order, holding `offset` tokens),
    and they attend to it causally, as the same tokens in a prefill forward of their
    own would.  The step reads the weights once for the batch and the prompt."""

    layers: list[Any]
    offset: int
    rows: int

    @property
    def state(self) -> list[mx.array]:
        """Its caches' arrays, to evaluate with the step."""
        return [a for c in self.layers for a in c.state if a is not None]


def _grow(parts: Parts, need: int) -> Parts:
    cap = parts[0].shape[2]
    if need <= cap:
        return parts
    extra = -(-(need - cap) // STEP) * STEP
    return [mx.concatenate([p, mx.zeros((*p.shape[:2], extra, p.shape[3]), p.dtype)], axis=2)
            for p in parts]


def _parts(x: Any) -> Parts | None:
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]


class RowsKV:
    """One attention layer of the batch: keys and values of every segment's rows,
    (rows, H, cap, D) each, in the layout's order of segments."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.keys: list[Parts | None] = []  # per segment; None: its rows hold no KV yet
        self.values: list[Parts | None] = []
        self.rider: Any = None  # the riding prompt's cache of this layer, for one step

    # -- mlx-lm's cache protocol, as the attention layers call it --------------

    @property
    def offset(self) -> mx.array:
        return self.layout.positions

    def _pack(self, x: mx.array) -> Parts:
        return [x]

    def _view(self, parts: Parts, end: int) -> Any:
        return parts[0][..., :end, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        lay = self.layout
        start, n = lay.idx, keys.shape[2]
        rider, rider_keys, rider_values = self.rider, None, None
        if rider is not None:  # the batch's last rows are a prompt's: its own cache
            B = lay.rows
            rider_keys, rider_values = rider.update_and_fetch(fold(keys[B:]), fold(values[B:]))
            keys, values = keys[:B], values[:B]
        k, v = self._pack(keys), self._pack(values)
        whole = len(lay.segs) == 1 and rider is None
        out_k: list[tuple[int, int, int, Any]] = []
        out_v: list[tuple[int, int, int, Any]] = []
        a = 0
        for i, seg in enumerate(lay.segs):
            b = a + seg.rows
            local = start - seg.col
            kp = _write(self.keys[i], k if whole else [p[a:b] for p in k], local)
            vp = _write(self.values[i], v if whole else [p[a:b] for p in v], local)
            self.keys[i], self.values[i] = kp, vp
            out_k.append((a, b, seg.col, self._view(kp, local + n)))
            out_v.append((a, b, seg.col, self._view(vp, local + n)))
            a = b
        if whole:  # one buffer from column 0: mlx-lm's own attention, as a row alone
            return out_k[0][3], out_v[0][3]
        if rider is None:
            return Ragged(tuple(out_k)), Ragged(tuple(out_v))
        return (Ragged(tuple(out_k), lay.rows, rider_keys, rider),
                Ragged(tuple(out_v), lay.rows, rider_values, rider))

    def make_mask(self, N: int, return_array: bool = False, **_: Any) -> mx.array | str | None:
        return self.layout.mask(N)

    @property
    def state(self) -> list[mx.array]:
        return [p for parts in (*self.keys, *self.values) if parts is not None for p in parts]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.state)

    def is_trimmable(self) -> bool:
        return False  # rows roll back one by one (`RowsCache.roll_back`), never all at once

    # -- structure, driven by RowsCache ---------------------------------------

    def adopt(self, layer: Any) -> None:
        """A joining row's own buffer (a single-row cache's layer) as a new segment."""
        self.keys.append(_parts(layer.keys))
        self.values.append(_parts(layer.values))

    def adopt_rows(self, layer: Any, width: int) -> None:
        """Joining rows' stacked buffer, cut to `width` columns, as a new segment."""
        for bufs, parts in ((self.keys, _parts(layer.keys)), (self.values, _parts(layer.values))):
            bufs.append(None if parts is None else [p[..., :width, :] for p in parts])

    def merge(self, first: int, end: int, segs: Sequence[Seg], idx: int) -> None:
        """Segments [first, end) into one buffer that begins at their first column: each
        segment's columns up to `idx` are copied once, into place."""
        group = segs[first:end]
        col = min(s.col for s in group)
        rows = sum(s.rows for s in group)
        cap = -(-(idx + 1 - col) // STEP) * STEP
        self.keys[first:end] = [_merged(self.keys[first:end], group, rows, col, cap, idx)]
        self.values[first:end] = [_merged(self.values[first:end], group, rows, col, cap,
                                          idx)]

    def keep(self, i: int, index: list[int] | None, lead: int) -> None:
        """Segment i keeps the rows at `index` (None: all) from its column `lead` on."""
        for bufs in (self.keys, self.values):
            parts = bufs[i]
            if parts is None:
                continue
            if lead:
                parts = [p[..., lead:, :] for p in parts]
            if index is not None:
                at = mx.array(index, dtype=mx.int32)
                parts = [p[at] for p in parts]
            bufs[i] = parts

    def remove(self, i: int) -> None:
        del self.keys[i], self.values[i]

    def gather(self, i: int, index: mx.array, end: int) -> None:
        """Segment i's columns re-gathered: index (rows, width) of its own columns."""
        at = index[:, None, :, None]
        for bufs in (self.keys, self.values):
            parts = bufs[i]
            if parts is not None:
                bufs[i] = [mx.take_along_axis(p[..., :end, :], at, axis=2) for p in parts]


def _write(parts: Parts | None, new: Parts, local: int) -> Parts:
    """`new` (rows, H, n, D) written at column `local` of the buffer, grown to fit (a
    segment of rows with no KV yet gets one, zero before `local`)."""
    n = new[0].shape[2]
    if parts is None:
        cap = -(-(local + n) // STEP) * STEP
        parts = [mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype) for p in new]
    parts = _grow(parts, local + n)
    for buf, x in zip(parts, new, strict=True):
        buf[..., local : local + n, :] = x
    return parts


def _merged(bufs: Sequence[Parts | None], segs: Sequence[Seg], rows: int, col: int,
            cap: int, idx: int) -> Parts | None:
    """One buffer of `rows` rows and `cap` columns from column `col`: zero but for each
    segment's columns before `idx`, moved to their place."""
    ref = next((p for p in bufs if p is not None), None)
    if ref is None:
        return None
    out: Parts = []
    for j, r in enumerate(ref):
        buf = mx.zeros((rows, r.shape[1], cap, r.shape[3]), r.dtype)
        a = 0
        for parts, seg in zip(bufs, segs, strict=True):
            width = idx - seg.col
            if parts is not None and width > 0:
                at = seg.col - col
                buf[a : a + seg.rows, :, at : at + width, :] = parts[j][..., :width, :]
            a += seg.rows
        out.append(buf)
    return out


class RowsQuantizedKV(RowsKV):
    """The q8 lane: keys and values quantized along the feature axis, as mlx-lm's
    `QuantizedKVCache` stores them (so attention takes the quantized path)."""

    def __init__(self, layout: Layout, group_size: int, bits: int) -> None:
        super().__init__(layout)
        self.group_size = group_size
        self.bits = bits

    def _pack(self, x: mx.array) -> Parts:
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _view(self, parts: Parts, end: int) -> Any:
        return tuple(p[..., :end, :] for p in parts)


@dataclass
class Mirror:
    """The layout as a plain step left it (`pos`, `valid`: host copies), and the same on
    the device: its rows' positions, and their columns' validity where the step needed a
    mask (None where it did not)."""

    pos: np.ndarray
    valid: np.ndarray
    positions: mx.array
    columns: mx.array | None


class Layout:
    """Which columns hold which row's tokens; the attention layers' shared view.

    A step's positions and mask are the host's (numpy) layout copied to the device, two
    arrays a step.  A decode step on CUDA is host-bound, and there building them took
    0.17-0.21 ms of a 2.3-2.8 ms plain step at 2-16 rows and 0.05 ms of a row's alone
    (traced in-process on an H100, demo model; mlx-lm's bare loop of batched forwards
    steps in 1.2-1.7 ms there).  So a plain step (one token a row, every row
    stepping, no prompt riding) leaves its positions plus one and its mask's columns on
    the device (`Mirror`), and the next plain step takes them from there when the
    host's layout is still exactly what that step left (compared by value: whatever
    changed it since, a roll-back, a row leaving or joining, a compaction, the step
    copies the host's again).  The values are the same either way."""

    def __init__(self) -> None:
        self.idx = 0  # the next write column, the same for every row
        self.valid = np.zeros((0, 0), dtype=bool)  # (B, idx): column holds a live token
        self.pos = np.zeros((0,), dtype=np.int64)  # (B,): position of each row's next token
        self.positions = mx.zeros((0,), dtype=mx.int32)
        self.segs: list[Seg] = []  # the rows' segments, in row order
        self._step: np.ndarray | None = None  # (B, n) real tokens of the step in flight
        self._n = 0
        self._mask: mx.array | str | None = None
        self._plain = False  # the step in flight is a plain one (`Mirror`)
        self._after: mx.array | None = None  # its mask's columns, (B, idx + 1)
        self._mirror: Mirror | None = None
        self._one: mx.array | None = None  # the int32 one a plain step adds to positions
        self._trues: dict[int, mx.array] = {}  # by B: a column of B trues, made once

    @property
    def rows(self) -> int:
        return int(self.valid.shape[0])

    def _column(self, b: int) -> mx.array:
        if b not in self._trues:
            self._trues[b] = mx.ones((b, 1), dtype=mx.bool_)
        return self._trues[b]

    def _mirrored(self) -> Mirror | None:
        """The last plain step's mirror, if the host's layout is still what it left."""
        m = self._mirror
        if m is None or m.pos.shape != self.pos.shape or m.valid.shape != self.valid.shape:
            return None
        if not (np.array_equal(m.pos, self.pos) and np.array_equal(m.valid, self.valid)):
            return None
        return m

    def begin(self, counts: Sequence[int], n: int, riding: Sequence[int] = ()) -> None:
        """A step of `n` tokens per row, counts[b] of them row b's own; `riding`: the
        positions of a riding prompt's rows, which follow the batch's."""
        step = np.arange(n)[None, :] < np.asarray(counts, dtype=np.int64)[:, None]
        self._step, self._n = step, n
        self._plain = n == 1 and not riding and bool(step.all())
        self._after = None
        mirror = self._mirrored() if self._plain else None
        self._mirror = None
        if mirror is not None:
            self.positions = mirror.positions
        else:
            self.positions = mx.array(np.concatenate(
                [self.pos, np.asarray(riding, dtype=np.int64)]).astype(np.int32))
        if len(self.segs) == 1 and self.valid.all() and step.all():
            # No padding, no holes: mlx-lm's own masks (none for one token, "causal"
            # otherwise), so a row alone computes exactly what a request alone does.
            self._mask = None if n == 1 else "causal"
            return
        if self._plain:  # one token a row, each seeing its valid columns and itself
            columns = mirror.columns if mirror is not None and mirror.columns is not None \
                else mx.array(self.valid)
            self._after = mx.concatenate([columns, self._column(self.rows)], axis=1)
            self._mask = self._after[:, None, None, :]
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
        if self._plain:
            if self._one is None:
                self._one = mx.array(1, dtype=mx.int32)
            self._mirror = Mirror(self.pos.copy(), self.valid.copy(),
                                  self.positions + self._one, self._after)
        self._step, self._mask, self._after, self._plain = None, None, None, False

    def first_used(self, a: int, b: int) -> int:
        """The first column any of rows [a, b) holds a token in (idx: none)."""
        used = self.valid[a:b].any(axis=0)
        return int(np.argmax(used)) if used.any() else self.idx


# How a model's rows batch, probed once per model and lane (`_probe`): by id, with a
# weak reference that proves the id is still that model's.
RIDING, RAGGED, MERGED, UNBATCHABLE = "riding", "ragged", "merged", "unbatchable"
_PROBED: dict[tuple[int, str], tuple[weakref.ref[Any], str]] = {}


class RowsCache:
    """Every layer's cache for the rows of one batch, in the model's layer order."""

    capacity: int | None = None  # rows it can hold: any number

    def __init__(self, layers: list[Any], layout: Layout, ragged: bool = False) -> None:
        self.layers = layers
        self.layout = layout
        self.ragged = ragged  # segments may stay apart (else every join merges)
        self.riding = False  # a prompt may ride a step (`Rider`; the probe found it can)
        # row-columns a segment's own operations cost, on this backend
        self.segment_cost = segment_cost(backend())
        self._settled = True

    @classmethod
    def for_model(cls, model: Any, kv: str) -> RowsCache:
        batch = cls._empty(model, kv)
        key = (id(model), kv)
        known = _PROBED.get(key)
        if known is None or known[0]() is not model:
            known = (weakref.ref(model), _probe(model, kv, rows_attention.install(model)))
            _PROBED[key] = known
        if known[1] == UNBATCHABLE:
            raise Unbatchable(f"{type(model).__module__}: rows batched do not decode as "
                              "they do alone")
        batch.ragged = known[1] in (RAGGED, RIDING)
        batch.riding = known[1] == RIDING
        return batch

    @classmethod
    def _empty(cls, model: Any, kv: str) -> RowsCache:
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
    def segments(self) -> int:
        return len(self.layout.segs)

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

    def begin(self, counts: Sequence[int], n: int, rider: Rider | None = None) -> None:
        """Before a forward of `n` tokens per row, of which counts[b] are row b's own;
        `rider`: a prompt whose next `rider.rows * n` tokens follow as rows of their own
        (the forward's input has them after the batch's rows)."""
        self._settle()
        riding: list[int] = []
        if rider is not None:
            if not self.riding:
                raise ValueError("this batch's model takes no riding prompt")
            riding = [rider.offset + i * n for i in range(rider.rows)]
            if self.recurrent_layers or len(rider.layers) != len(self.layers) \
                    or any(type(c) not in KV_LAYERS for c in rider.layers):
                raise ValueError("a riding prompt needs KV caches for every layer")
            for layer, theirs in zip(self.kv_layers, rider.layers, strict=True):
                layer.rider = theirs
        self.layout.begin(counts, n, riding)
        ragged = any(c != n for c in counts)
        for c in self.recurrent_layers:
            c.lengths = mx.array(list(counts), dtype=mx.int32) if ragged else None

    def end(self) -> None:
        self.layout.end()
        for c in self.recurrent_layers:
            c.lengths = None
        for layer in self.kv_layers:
            layer.rider = None

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
        # A segment's buffer begins at its column: the write column never goes before it.
        last = max([last, *(s.col for s in lay.segs)])
        if last < lay.idx:
            lay.valid = lay.valid[:, :last]
            lay.idx = last

    # -- rows joining and leaving ---------------------------------------------

    def join(self, row: list[Any], length: int) -> None:
        """Append a prefilled single-row cache (of this lane's layer types) holding
        `length` tokens; its next token is at position `length`.  Its buffers become a
        segment as they are; a row longer than the batch's columns moves the others'
        segments right (their first column, not their KV)."""
        for mine, theirs in zip(self.layers, row, strict=True):
            if isinstance(mine, RowsKV):
                mine.adopt(theirs)
            else:
                _add_arrays_row(mine, theirs, self.layout.rows)
        self._place([length])

    @property
    def joins_rows(self) -> bool:
        """Whether rows prefilled together join as one segment (`join_rows`): every layer
        keeps its tokens by column (no recurrent state to split by row)."""
        return not self.recurrent_layers

    def join_rows(self, rows: list[Any], lengths: Sequence[int]) -> None:
        """Append the rows of a stacked prefilled cache (mlx-lm's KV caches, one per
        layer), row r holding its `lengths[r]` tokens from the buffer's column 0 (filler
        after them, from a padded prefill, is cut off or left as holes); each row's next
        token is at position lengths[r].  Their buffer, cut to the longest row's tokens,
        becomes one segment as it is: joining them one by one takes each row apart and
        copies it back as a segment of its own, some four operations a row and a layer
        (on a GPU each an encoded kernel: 15 rows joining a 10-layer model's batch made
        their step 2,712 operations against a steady step's 1,431).  A shorter row's
        columns after its own are holes (invalid for it, as a rolled-back draft's)."""
        width = max(lengths)
        for mine, theirs in zip(self.layers, rows, strict=True):
            if not isinstance(mine, RowsKV):
                raise ValueError("rows join together only where every layer is KV")
            mine.adopt_rows(theirs, width)
        self._place(lengths)

    def _place(self, lengths: Sequence[int]) -> None:
        """The layout of a segment just adopted: rows holding `lengths` tokens each from
        its first column, which is the longest's distance before the write column (a
        longer row than the batch's columns moves the others' segments right)."""
        lay = self.layout
        width = max(lengths)
        shift = max(0, width - lay.idx)
        for s in lay.segs:
            s.col += shift
        idx = lay.idx + shift
        col = idx - width
        lay.segs.append(Seg(len(lengths), col))
        valid = np.zeros((len(lengths), idx), dtype=bool)
        for r, n in enumerate(lengths):
            valid[r, col : col + n] = True
        if lay.rows:
            padded = np.concatenate([np.zeros((lay.rows, shift), dtype=bool), lay.valid],
                                    axis=1)
            lay.valid = np.concatenate([padded, valid])
        else:
            lay.valid = valid
        lay.idx = idx
        lay.pos = np.concatenate([lay.pos, np.asarray(lengths, dtype=np.int64)])
        self._settled = False

    def _settle(self) -> None:
        """Merge the segments that one buffer holds for less (`seatd.kv_segments`); all of
        them where the model's layers cannot attend segment by segment."""
        if self._settled:
            return
        lay = self.layout
        runs = (merge_runs([(s.rows, s.col) for s in lay.segs], lay.idx,
                           self.segment_cost) if self.ragged
                else [(0, len(lay.segs))])
        for first, end in reversed(runs):
            if end - first < 2:
                continue
            for c in self.kv_layers:
                c.merge(first, end, lay.segs, lay.idx)
            group = lay.segs[first:end]
            lay.segs[first:end] = [Seg(sum(s.rows for s in group), min(s.col for s in group))]
        self._settled = True

    def drop(self, keep: Sequence[int]) -> None:
        """Keep only the rows at these indices, in this order (ascending)."""
        lay = self.layout
        if not keep:
            self._reset()
            return
        wanted = list(keep)
        if wanted != sorted(set(wanted)):
            raise ValueError("rows are kept in their order")
        lay.valid = lay.valid[wanted]
        lay.pos = lay.pos[wanted]
        index = mx.array(wanted, dtype=mx.int32)
        for c in self.recurrent_layers:
            c.cache = [x[index] if x is not None else None for x in c.cache]
        a, i, k = 0, 0, 0
        for seg in list(lay.segs):
            b = a + seg.rows
            mine = [r - a for r in wanted if a <= r < b]
            if not mine:
                for c in self.kv_layers:
                    c.remove(i)
                lay.segs.pop(i)
            else:
                # The columns none of its rows left uses are cut before they are
                # gathered: a long row leaving copies only the short rows' columns.
                first = max(seg.col, lay.first_used(k, k + len(mine)))
                lead = first - seg.col
                cut = lead >= STEP or len(mine) < seg.rows
                for c in self.kv_layers:
                    c.keep(i, None if len(mine) == seg.rows else mine, lead if cut else 0)
                if cut:
                    seg.col = first
                seg.rows = len(mine)
                i += 1
                k += len(mine)
            a = b
        lead = min(s.col for s in lay.segs)
        if lead:
            for s in lay.segs:
                s.col -= lead
            lay.valid = lay.valid[:, lead:]
            lay.idx -= lead
        self._reclaim_tail()
        self._settled = False

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
        """Squeeze every row's live columns together, right-aligned at the write column;
        each segment keeps as many columns as its longest row needs."""
        lay = self.layout
        if not lay.rows:
            return
        counts = lay.valid.sum(axis=1)
        width = int(counts.max())
        valid = np.zeros((lay.rows, width), dtype=bool)
        a = 0
        for i, seg in enumerate(lay.segs):
            b = a + seg.rows
            own = int(counts[a:b].max())
            gather = np.zeros((seg.rows, own), dtype=np.int32)
            for r in range(seg.rows):
                cols = np.nonzero(lay.valid[a + r])[0] - seg.col
                gather[r, own - len(cols):] = cols
                valid[a + r, width - len(cols):] = True
            for c in self.kv_layers:
                c.gather(i, mx.array(gather), lay.idx - seg.col)
            seg.col = width - own
            a = b
        lay.valid, lay.idx = valid, width


PROBE_ROWS = ([1, 2, 3, 4, 5], [6, 7])  # two prompts of different lengths


def _probe(model: Any, kv: str, routed: bool) -> str:
    """How this model's rows batch: two rows of different lengths, one step, each row's
    logits against the same row alone.  RAGGED where they agree with the rows in two
    segments (`routed`: the model's attention goes through `seatd.rows_attention`);
    else MERGED where they agree in one buffer; else UNBATCHABLE (a layer that reads
    the batch's mask or keys its own way: the lane decodes one row at a time)."""
    alone = []
    for tokens in PROBE_ROWS:
        cache = make_cache(model, kv)
        model(mx.array([tokens[:-1]]), cache=cache)
        with recurrent.recording():
            alone.append(model(mx.array([tokens[-1:]]), cache=cache)[0, -1])
    for mode in ((RAGGED, MERGED) if routed else (MERGED,)):
        try:
            batch = RowsCache._empty(model, kv)
            batch.ragged = mode == RAGGED
            batch.segment_cost = 0  # rows of different lengths stay apart
            for tokens in PROBE_ROWS:
                row = make_cache(model, kv)
                model(mx.array([tokens[:-1]]), cache=row)
                batch.join(row, len(tokens) - 1)
            batch.begin([1] * len(PROBE_ROWS), 1)
            with recurrent.recording():
                logits = model(mx.array([t[-1:] for t in PROBE_ROWS]), cache=batch.layers)
            batch.end()
            if all(_agree(logits[b, -1], a) for b, a in enumerate(alone)):
                return RIDING if mode == RAGGED and _rides(model, kv) else mode
        except Exception as exc:  # this mode cannot: the next, else one row at a time
            log.warning("rows_probe_failed", model=type(model).__module__, kv=kv,
                        mode=mode, error=repr(exc))
    log.warning("rows_unbatchable", model=type(model).__module__, kv=kv)
    return UNBATCHABLE


RIDE_ROWS = ([1, 2, 3, 4, 5], [6, 7, 15])  # rows of different lengths, 2 tokens a step
RIDE_PROMPT = [8, 9, 10, 11, 12, 13, 14]  # 2 tokens prefilled, 4 riding, 1 decoded


def _rides(model: Any, kv: str) -> bool:
    """Whether a prompt riding a step (`Rider`) holds what a prefill of its own would:
    the probe's rows take a step of 2 tokens each with 2 rows of the prompt's riding,
    then the prompt's last token is decoded from its cache and compared with the same
    prompt prefilled alone; the rows' logits too."""
    if any(type(c) not in KV_LAYERS for c in make_cache(model, kv)):
        return False  # recurrent layers take a prompt's tokens in order, never as rows
    try:
        alone = make_cache(model, kv)
        model(mx.array([RIDE_PROMPT[:-1]]), cache=alone)
        want = model(mx.array([RIDE_PROMPT[-1:]]), cache=alone)[0, -1]
        rows = []
        for tokens in RIDE_ROWS:
            cache = make_cache(model, kv)
            model(mx.array([tokens[:-2]]), cache=cache)
            rows.append(model(mx.array([tokens[-2:]]), cache=cache)[0, -1])
        batch = RowsCache._empty(model, kv)
        batch.ragged = batch.riding = True
        batch.segment_cost = 0
        for tokens in RIDE_ROWS:
            row = make_cache(model, kv)
            model(mx.array([tokens[:-2]]), cache=row)
            batch.join(row, len(tokens) - 2)
        prompt = make_cache(model, kv)
        model(mx.array([RIDE_PROMPT[:2]]), cache=prompt)
        batch.begin([2] * len(RIDE_ROWS), 2, Rider(prompt, 2, 2))
        x = mx.array([t[-2:] for t in RIDE_ROWS] + [RIDE_PROMPT[2:4], RIDE_PROMPT[4:6]])
        logits = model(x, cache=batch.layers)
        batch.end()
        got = model(mx.array([RIDE_PROMPT[-1:]]), cache=prompt)[0, -1]
        return _agree(got, want) and all(_agree(logits[b, -1], a) for b, a in enumerate(rows))
    except Exception as exc:  # a model that cannot: prompts prefill in forwards of their own
        log.warning("rows_ride_probe_failed", model=type(model).__module__, kv=kv,
                    error=repr(exc))
        return False


def _agree(a: mx.array, b: mx.array) -> bool:
    """Logits equal but for the order of float sums, relative to the largest logit:
    1% in float32, 10% in a 16-bit dtype (rounded a thousand times coarser, and summed
    in other orders on a GPU).  A mask read the wrong way (gemma2 with grouped keys)
    moved them by 64% in float32 and in bfloat16; the demo models batched, in either
    16-bit dtype and either KV lane, by 0 on this CPU."""
    share = 1e-2 if a.dtype == mx.float32 else 1e-1
    scale = mx.maximum(mx.abs(b.astype(mx.float32)).max(), 1.0)
    gap = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
    return bool((gap <= share * scale).item())


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

    def begin(self, counts: Sequence[int], n: int, rider: Rider | None = None) -> None:
        assert len(counts) == 1 and counts[0] == n and rider is None

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

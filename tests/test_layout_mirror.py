"""The rows' layout on the device: a plain step takes its positions and mask from the
last plain step's mirror (no array copied from the host), and every step's positions and
mask are the host layout's, whatever changed it between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from seatd import rows_cache
from seatd.rows_cache import Layout, Seg


def _layout(valid: list[list[bool]], segs: list[Seg]) -> Layout:
    lay = Layout()
    lay.valid = np.array(valid, dtype=bool)
    lay.pos = lay.valid.sum(axis=1).astype(np.int64)
    lay.idx = lay.valid.shape[1]
    lay.segs = segs
    return lay


def _want_mask(lay: Layout, counts: list[int], n: int) -> np.ndarray | str | None:
    step = np.arange(n)[None, :] < np.asarray(counts)[:, None]
    if len(lay.segs) == 1 and lay.valid.all() and step.all():
        return None if n == 1 else "causal"
    after = np.concatenate([lay.valid, step], axis=1)
    causal = np.arange(lay.idx + n)[None, :] <= (lay.idx + np.arange(n))[:, None]
    return after[:, None, None, :] & causal[None, None]


def _check_step(lay: Layout, counts: list[int], n: int) -> None:
    want_pos = [int(p) for p in lay.pos]
    want = _want_mask(lay, counts, n)
    lay.begin(counts, n)
    assert lay.positions.tolist() == want_pos
    got = lay.mask(n)
    if want is None or isinstance(want, str):
        assert got == want
    else:
        assert isinstance(got, mx.array)
        assert got.dtype == mx.bool_
        assert np.array_equal(np.array(got), want)
    lay.end()


def _roll_back_last(lay: Layout, b: int) -> None:
    lay.pos[b] -= 1
    lay.valid[b, lay.idx - 1] = False  # in place, as RowsCache.roll_back does


def _drop_first(lay: Layout) -> None:
    lay.valid, lay.pos = lay.valid[1:], lay.pos[1:]
    lay.segs = [Seg(lay.rows, 0)]


def _join_short(lay: Layout) -> None:
    lay.valid = np.concatenate([lay.valid, np.zeros((1, lay.idx), dtype=bool)])
    lay.valid[-1, lay.idx - 2:] = True
    lay.pos = np.concatenate([lay.pos, [2]])
    lay.segs = [Seg(lay.rows, 0)]


Edit = Callable[[Layout], None]
PLAIN2 = ([1, 1], 1)


@pytest.mark.parametrize("edits", [
    # plain steps only: the mirror carries every step after the first
    [None, None, None, None],
    # a row rolled back in place between plain steps
    [None, lambda lay: _roll_back_last(lay, 0), None, None],
    # a verify-like step (ragged block) between plain steps
    [None, ("step", [3, 1], 3), None, None],
    # a row leaving, then steps of the one left (no padding: mlx-lm's masks)
    [None, _drop_first, ("step", [1], 1), ("step", [1], 1)],
    # a row joining between plain steps
    [None, _join_short, ("step", [1, 1, 1], 1), ("step", [1, 1, 1], 1)],
])
def test_every_step_sees_the_host_layout(edits: list[Any]) -> None:
    lay = _layout([[False, False, True, True], [True, True, True, True]],
                  [Seg(2, 0)])
    for edit in edits:
        if edit is None:
            _check_step(lay, *PLAIN2) if lay.rows == 2 else _check_step(lay, [1] * lay.rows, 1)
        elif isinstance(edit, tuple):
            _check_step(lay, edit[1], edit[2])
        else:
            edit(lay)
            _check_step(lay, [1] * lay.rows, 1)


class _Counting:
    """`mlx.core` as rows_cache sees it, counting arrays made from host data."""

    def __init__(self) -> None:
        self.made = 0

    def array(self, *args: Any, **kwargs: Any) -> mx.array:
        self.made += 1
        return mx.array(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


def test_steady_plain_steps_copy_nothing_from_the_host(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    counting = _Counting()
    monkeypatch.setattr(rows_cache, "mx", counting)
    lay = _layout([[False, True, True], [True, True, True]], [Seg(2, 0)])
    made = []
    for _ in range(4):
        before = counting.made
        _check_step(lay, *PLAIN2)
        made.append(counting.made - before)
    assert made[0] >= 2  # the first copies positions and columns
    assert made[1:] == [0, 0, 0]
    _roll_back_last(lay, 1)
    before = counting.made
    _check_step(lay, *PLAIN2)
    assert counting.made - before >= 2  # the host's layout changed: copied again

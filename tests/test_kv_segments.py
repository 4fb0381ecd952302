"""Which segments of a batch share a buffer: `seatd.kv_segments.merge_runs`."""

from __future__ import annotations

import pytest

from seatd.kv_segments import merge_runs, segment_cost


@pytest.mark.parametrize(("segs", "width", "fixed", "runs"), [
    ([], 10, 512, []),
    ([(3, 0)], 10, 512, [(0, 1)]),
    # Rows alike in length: one buffer costs a few padded columns, less than a segment.
    ([(1, 0), (1, 3), (1, 5)], 400, 512, [(0, 3)]),
    # A long row beside short ones: 7 x 1,167 padded columns against one segment more.
    ([(7, 1167), (1, 0)], 1500, 512, [(0, 1), (1, 2)]),
    ([(1, 0), (7, 1167)], 1500, 512, [(0, 1), (1, 2)]),
    # Free segments: only rows at one column share a buffer.
    ([(2, 4), (1, 4), (1, 6)], 10, 0, [(0, 2), (2, 3)]),
    # Exactly as costly either way: one buffer (fewer operations for equal work).
    ([(1, 0), (1, 10)], 20, 10, [(0, 2)]),
    ([(1, 0), (1, 11)], 20, 10, [(0, 1), (1, 2)]),
    # Short, long, short: the long row stays apart, the short ones beside it too.
    ([(3, 900), (1, 0), (3, 905)], 1000, 512, [(0, 1), (1, 2), (2, 3)]),
])
def test_merge_runs(segs: list[tuple[int, int]], width: int, fixed: int,
                    runs: list[tuple[int, int]]) -> None:
    assert merge_runs(segs, width, fixed) == runs


@pytest.mark.parametrize(("backend", "segs", "width", "runs"), [
    # Groups that joined at different times, on the CPU: the first 120 columns ahead of
    # the rest stays apart (8 x 120 padded columns cost more than a segment).
    ("cpu", [(4, 0), (8, 120), (4, 200)], 420, [(0, 1), (1, 3)]),
    # ... on CUDA a segment's launches cost more than padding them all: one buffer.
    ("cuda", [(4, 0), (8, 120), (4, 200)], 420, [(0, 3)]),
    # The long prompt among 7 rows: one buffer on CUDA too, apart on the CPU.
    ("cuda", [(7, 1167), (1, 0)], 1500, [(0, 2)]),
    ("cpu", [(7, 1167), (1, 0)], 1500, [(0, 1), (1, 2)]),
    # Past what a segment costs there, a long row keeps its own buffer on CUDA as well.
    ("cuda", [(7, 30000), (1, 0)], 30400, [(0, 1), (1, 2)]),
    # Metal was not measured: the CPU's figure.
    ("metal", [(7, 1167), (1, 0)], 1500, [(0, 1), (1, 2)]),
])
def test_segments_by_backend(backend: str, segs: list[tuple[int, int]], width: int,
                             runs: list[tuple[int, int]]) -> None:
    assert merge_runs(segs, width, segment_cost(backend)) == runs

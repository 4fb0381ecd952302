"""Which rows of a batch share one KV buffer: a pure decision, table-tested.

A batch's rows write at one shared column, but a row only attends from its own first
column on.  Rows of very different lengths in one buffer (a 1,500-token prompt beside
short chats) make every short row attend over the long row's width, padding that is
masked out but still computed: on this 2-core CPU a step of 7 short rows and one long
one took 142 ms in one buffer and 70 ms with the long row in a buffer of its own.  So
the batch keeps its rows in segments, consecutive rows with a buffer each, and attends
segment by segment (`seatd.rows_attention`).

A segment costs its rows times its width in attention work, plus a fixed part for the
extra operations of each segment, in the same unit (row-columns).  Adjacent segments
are merged, a copy once, when one buffer would cost no more than two:

    merge_runs([(rows, first column), ...], width, fixed) -> [(first, end), ...]
    segment_cost(backend) -> fixed          a segment's own cost on that backend

where `width` is the write column, and each run of segments [first, end) becomes one.
"""

from __future__ import annotations

from collections.abc import Sequence

# A segment's fixed cost in row-columns: on this CPU a segment more in a step costs
# about what 120 row-columns of attention do (0.1 ms a layer against 0.84 us).  Rows
# this much apart in length and more keep buffers of their own.
SEGMENT_COST = 512
# On CUDA a segment's own operations are kernel launches, and a row-column of attention
# is a few nanoseconds of memory traffic (the demo's 768 bytes of keys and values a
# layer, 10 layers, at an H100's 3 TB/s: 2.6 ns).  Traced through the batching bench on
# two H100s (demo, bfloat16), the same batch sizes stepped plainly in 2.46 / 3.88 ms (7
# rows) and 4.05 ms (16) with one buffer fewer against 3.58 / 5.67 / 4.80 ms: 0.75-1.8
# ms a segment, what some 2e5 row-columns cost.  So rows keep buffers of their own there
# only past that (7 short rows beside a 30,000-token prompt), and a batch is one buffer.
GPU_SEGMENT_COST = 1 << 17
MEASURED_GPU = ("cuda",)  # Metal, not measured here, keeps the CPU's figure


def segment_cost(backend: str) -> int:
    """A segment's fixed cost in row-columns on `backend`.  Pure."""
    return GPU_SEGMENT_COST if backend in MEASURED_GPU else SEGMENT_COST


def _cost(rows: int, col: int, width: int) -> int:
    return rows * max(0, width - col)


def merge_runs(segs: Sequence[tuple[int, int]], width: int,
               fixed: int = SEGMENT_COST) -> list[tuple[int, int]]:
    """Runs of adjacent segments to hold in one buffer each, left to right: a segment
    joins the run before it when the run's cost with it, in one buffer, is at most the
    two apart (`fixed` for the second's own operations).  Every segment is in exactly
    one run; a run of one is left as it is."""
    runs: list[tuple[int, int]] = []
    first = 0
    rows, col = (segs[0] if segs else (0, 0))
    for i in range(1, len(segs)):
        r, c = segs[i]
        together = _cost(rows + r, min(col, c), width)
        apart = _cost(rows, col, width) + _cost(r, c, width) + fixed
        if together <= apart:
            rows, col = rows + r, min(col, c)
            continue
        runs.append((first, i))
        first, rows, col = i, r, c
    if segs:
        runs.append((first, len(segs)))
    return runs

"""The batch's cache against a request alone, on the packaged models: rows that join
with different histories, a verify step where each row keeps a different number of
its tokens, rows leaving, and compaction all give each row the logits it would get
alone (to float tolerance: batch shapes change reduction orders)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent
from seatd.engine_types import make_cache
from seatd.kv_segments import SEGMENT_COST
from seatd.rows_cache import OneRow, Rider, RowsCache, Unbatchable, lane_cache
from tests.lanes import logits_close

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
SHORT, ONE = [40, 41, 42], [50]
LONG = list(range(60, 80))


class Alone:
    """One row decoded by itself with mlx-lm's own cache."""

    def __init__(self, model: Any, kv: str, prompt: list[int]) -> None:
        self.model = model
        self.cache = make_cache(model, kv)
        if len(prompt) > 1:  # a one-token prompt has nothing to prefill
            model(mx.array([prompt[:-1]]), cache=self.cache)

    def feed(self, tokens: list[int]) -> mx.array:
        with recurrent.recording():  # so a hybrid row can be trimmed after it
            return self.model(mx.array([tokens]), cache=self.cache)[0]  # (n, V)

    def trim(self, n: int) -> None:
        assert mlx_cache.trim_prompt_cache(self.cache, n) == n


@pytest.fixture(params=["merged", "apart"])
def batch_of(request: Any) -> Any:
    """Batches whose rows share buffers where that is cheaper (the default), or where
    each length keeps a buffer of its own, so attention runs segment by segment."""
    def make(model: Any, kv: str) -> RowsCache:
        batch = RowsCache.for_model(model, kv)
        assert batch.ragged, "the demo models attend segment by segment"
        batch.segment_cost = 0 if request.param == "apart" else SEGMENT_COST
        return batch
    return make


def _position(cache: list[Any]) -> int:
    return next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))


def _join(batch: RowsCache, model: Any, kv: str, prompt: list[int]) -> None:
    row = make_cache(model, kv)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=row)
        mx.eval([c.state for c in row])
    batch.join(row, len(prompt) - 1)


def _step(batch: RowsCache, model: Any, blocks: list[list[int]]) -> mx.array:
    n = max(len(b) for b in blocks)
    x = mx.array([b + [0] * (n - len(b)) for b in blocks])
    batch.begin([len(b) for b in blocks], n)
    with recurrent.recording():
        logits = model(x, cache=batch.layers)
    batch.end()
    return logits


def test_rows_decode_as_if_alone(lane: tuple[Any, str], batch_of: Any) -> None:
    model, kv = lane
    alone = [Alone(model, kv, p) for p in PROMPTS]
    batch = batch_of(model, kv)
    for p in PROMPTS[:2]:
        _join(batch, model, kv, p)
    ys = [PROMPTS[0][-1], PROMPTS[1][-1]]
    for step in range(5):
        if step == 2:  # a longer row joins mid-way: everyone else is padded to fit
            _join(batch, model, kv, PROMPTS[2])
            ys.append(PROMPTS[2][-1])
        logits = _step(batch, model, [[y] for y in ys])
        for b, y in enumerate(ys):
            assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), (step, b)
        ys = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]

    # A verify step: rows feed 3, 1 and 2 tokens and keep 2, 1 and 1 of them.
    blocks = [[ys[0], 7, 8], [ys[1]], [ys[2], 9]]
    logits = _step(batch, model, blocks)
    for b, block in enumerate(blocks):
        own = alone[b].feed(block)
        assert logits_close(logits[b, : len(block)], own, kv), b
    keeps = [2, 1, 1]
    batch.roll_back(keeps, 3)
    for b, (block, keep) in enumerate(zip(blocks, keeps, strict=True)):
        alone[b].trim(len(block) - keep)
    ys = [8, 11, 12]  # next tokens: any will do, both sides feed the same
    for _ in range(2):
        logits = _step(batch, model, [[y] for y in ys])
        for b, y in enumerate(ys):
            assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), b
        ys = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]

    # The middle row leaves; the holes are squeezed out; the others go on unchanged.
    batch.drop([0, 2])
    alone = [alone[0], alone[2]]
    ys = [ys[0], ys[2]]
    batch.compact()
    assert batch.holes() == 0
    logits = _step(batch, model, [[y] for y in ys])
    for b, y in enumerate(ys):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), b
    assert batch.layout.pos.tolist() == [_position(a.cache) for a in alone]


@pytest.mark.parametrize("order", [
    (SHORT, LONG, ONE),  # a longer row moves the rows there; a row with no KV yet
    (ONE, SHORT, LONG),  # the first row has no KV: the others' buffers begin with it
    (LONG, ONE, SHORT),  # shorter rows after a long one: nobody moves
])
def test_joins_in_any_order_decode_as_if_alone(lane: tuple[Any, str],
                                                order: tuple[list[int], ...],
                                                batch_of: Any) -> None:
    model, kv = lane
    batch = batch_of(model, kv)
    alone: list[Alone] = []
    ys: list[int] = []
    for prompt in order:  # each joins after a step of the rows already there
        _join(batch, model, kv, prompt)
        alone.append(Alone(model, kv, prompt))
        ys.append(prompt[-1])
        logits = _step(batch, model, [[y] for y in ys])
        for b, y in enumerate(ys):
            assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), (order, b)
        ys = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]
    assert batch.layout.pos.tolist() == [_position(a.cache) for a in alone]

    # The long row leaves: the columns only it used go, the others decode on unchanged.
    gone = order.index(LONG)
    keep = [b for b in range(len(order)) if b != gone]
    width = batch.layout.idx
    batch.drop(keep)
    assert batch.layout.idx < width
    alone, ys = [alone[b] for b in keep], [ys[b] for b in keep]
    logits = _step(batch, model, [[y] for y in ys])
    for b, y in enumerate(ys):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), (order, "after", b)


def test_rows_prefilled_together_join_as_one_segment_and_decode_as_if_alone(
        lane: tuple[Any, str], batch_of: Any) -> None:
    """Rows prefilled in one forward, the shorter ones padded with filler past their
    own prompts (as `seatd.prefill_rows.padded` feeds them), join in one call: their
    buffer becomes one segment with a hole after each shorter row's tokens, beside a
    row already decoding, and each row's logits are its own alone, before and after a
    verify step and a compaction.  A model with recurrent layers, whose state cannot
    carry filler, joins row by row."""
    model, kv = lane
    batch = batch_of(model, kv)
    if not batch.joins_rows:
        assert batch.recurrent_layers
        return
    _join(batch, model, kv, SHORT)
    group = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]  # 9, 6 and 3 tokens
    width = max(len(p) for p in group) - 1
    stacked = make_cache(model, kv)
    model(mx.array([p[:-1] + [p[-2]] * (width - len(p) + 1) for p in group]), cache=stacked)
    mx.eval([c.state for c in stacked])
    segments = batch.segments
    batch.join_rows(stacked, [len(p) - 1 for p in group])
    assert batch.rows == 4 and batch.segments == segments + 1
    assert batch.layout.valid.sum(axis=1).tolist() == [len(SHORT) - 1] + [
        len(p) - 1 for p in group]
    prompts = [SHORT, *group]
    alone = [Alone(model, kv, p) for p in prompts]
    assert batch.layout.pos.tolist() == [_position(a.cache) for a in alone]
    ys = [p[-1] for p in prompts]
    for _ in range(3):
        logits = _step(batch, model, [[y] for y in ys])
        for b, y in enumerate(ys):
            assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), b
        ys = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]
    blocks = [[ys[0]], [ys[1], 7, 8], [ys[2], 9], [ys[3]]]
    logits = _step(batch, model, blocks)
    for b, block in enumerate(blocks):
        assert logits_close(logits[b, : len(block)], alone[b].feed(block), kv), b
    keeps = [1, 1, 2, 1]
    batch.roll_back(keeps, 3)
    for b, (block, keep) in enumerate(zip(blocks, keeps, strict=True)):
        alone[b].trim(len(block) - keep)
    batch.compact()
    assert batch.holes() == 0
    ys = [3, 4, 5, 6]
    logits = _step(batch, model, [[y] for y in ys])
    for b, y in enumerate(ys):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), ("compacted", b)


def test_rolled_back_columns_are_invisible(lane: tuple[Any, str], batch_of: Any) -> None:
    """A rejected draft must not be seen by later steps: feeding garbage and rolling it
    back leaves the same logits as never feeding it."""
    model, kv = lane
    batch = batch_of(model, kv)
    _join(batch, model, kv, PROMPTS[0])
    _join(batch, model, kv, PROMPTS[1])
    clean = batch_of(model, kv)
    _join(clean, model, kv, PROMPTS[0])
    _join(clean, model, kv, PROMPTS[1])
    ys = [PROMPTS[0][-1], PROMPTS[1][-1]]
    _step(batch, model, [[ys[0], 999, 998, 997], [ys[1], 996]])
    batch.roll_back([1, 1], 4)
    _step(clean, model, [[ys[0]], [ys[1]]])
    a = _step(batch, model, [[3], [4]])
    b = _step(clean, model, [[3], [4]])
    assert logits_close(a[:, 0], b[:, 0], kv)
    assert batch.layout.pos.tolist() == clean.layout.pos.tolist() == [10, 4]
    # Some rows rejected everything, some nothing: both get their own state back.
    assert batch.rows == 2 and batch.nbytes > 0


def test_last_row_leaving_frees_the_batch(lane: tuple[Any, str], batch_of: Any) -> None:
    model, kv = lane
    batch = batch_of(model, kv)
    _join(batch, model, kv, PROMPTS[0])
    _step(batch, model, [[PROMPTS[0][-1]]])
    assert batch.nbytes > 0
    batch.drop([])
    assert batch.rows == 0 and batch.nbytes == 0 and batch.layout.idx == 0
    _join(batch, model, kv, PROMPTS[1])  # and it takes rows again
    assert batch.rows == 1


def test_a_long_row_joins_without_a_copy(lane: tuple[Any, str]) -> None:
    """A row far longer than the others joins as a segment of its own: its prefilled
    buffer is the batch's as it was (nobody's KV is copied), the rows decode as if
    alone, and when it leaves the rest is one segment again."""
    model, kv = lane
    batch = RowsCache.for_model(model, kv)
    shorts = [[5, 6, 7], [8, 9, 10, 11]]
    long = list(range(100, 700))
    alone = [Alone(model, kv, p) for p in [*shorts, long]]
    for p in shorts:
        _join(batch, model, kv, p)
    _step(batch, model, [[p[-1]] for p in shorts])
    for a, p in zip(alone, shorts, strict=False):
        a.feed([p[-1]])
    assert batch.segments == 1  # alike in length: one buffer
    row = make_cache(model, kv)
    model(mx.array([long[:-1]]), cache=row)
    mx.eval([c.state for c in row])
    theirs = [c.keys[0] if isinstance(c.keys, tuple) else c.keys
              for c in row if getattr(c, "keys", None) is not None]
    batch.join(row, len(long) - 1)
    assert batch.segments == 2
    assert all(c.keys[1] is not None and c.keys[1][0] is t
               for c, t in zip(batch.kv_layers, theirs, strict=True))
    ys = [1, 2, long[-1]]
    logits = _step(batch, model, [[y] for y in ys])
    assert batch.segments == 2  # 600 columns apart: two buffers cost less than one
    for b, y in enumerate(ys):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), b
    batch.drop([0, 1])
    assert batch.segments == 1 and batch.layout.idx < 600
    logits = _step(batch, model, [[3], [4]])
    for b, y in enumerate([3, 4]):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), ("after", b)


def test_a_prompt_riding_the_rows_steps_holds_its_own_prefill(lane: tuple[Any, str],
                                                                batch_of: Any) -> None:
    """A joining prompt's tokens ride the rows' steps as rows of their own (three in a
    one-token step, two of two tokens in a verify step, one where the step takes
    two): the rows' logits are theirs alone, and once the prompt is in, it joins and
    decodes as the same prompt prefilled by itself.  A hybrid model's recurrent layers
    take a prompt in order: its batch never takes a rider."""
    model, kv = lane
    batch = batch_of(model, kv)
    prompt = list(range(100, 114))  # 4 prefilled, 3 + 4 + 2 ride, then its last token
    if not batch.riding:
        assert batch.recurrent_layers, "a plain-attention model's batch takes riders"
        with pytest.raises(ValueError):
            batch.begin([1], 1, Rider(make_cache(model, kv), 0, 1))
        return
    alone = [Alone(model, kv, p) for p in PROMPTS[:2]]
    for p in PROMPTS[:2]:
        _join(batch, model, kv, p)
    own = make_cache(model, kv)
    model(mx.array([prompt[:4]]), cache=own)
    done = 4
    ys = [PROMPTS[0][-1], PROMPTS[1][-1]]
    for blocks, rows in (([[ys[0]], [ys[1]]], 3), ([[ys[0], 7], [ys[1], 9]], 2),
                         ([[8, 5], [11]], 1)):
        n = max(len(b) for b in blocks)
        riding = prompt[done : done + rows * n]
        x = mx.array([b + [0] * (n - len(b)) for b in blocks]
                     + [riding[i * n : (i + 1) * n] for i in range(rows)])
        batch.begin([len(b) for b in blocks], n, Rider(own, done, rows))
        logits = model(x, cache=batch.layers)
        batch.end()
        for b, block in enumerate(blocks):
            assert logits_close(logits[b, : len(block)], alone[b].feed(block), kv), (n, b)
        done += rows * n
        assert own[0].offset == done
    assert done == len(prompt) - 1
    batch.join(own, done)
    logits = _step(batch, model, [[1], [2], [prompt[-1]]])
    whole = Alone(model, kv, prompt)
    assert logits_close(logits[2, 0], whole.feed([prompt[-1]])[0], kv)
    for b, y in enumerate([1, 2]):
        assert logits_close(logits[b, 0], alone[b].feed([y])[0], kv), ("after", b)


def _gemma2(kv_heads: int) -> Any:
    from mlx_lm.models import gemma2

    mx.random.seed(3)
    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128, num_attention_heads=4, head_dim=16,
                            rms_norm_eps=1e-6, vocab_size=256, num_key_value_heads=kv_heads)
    model = gemma2.Model(args)
    mx.eval(model.parameters())
    return model


def test_a_model_that_cannot_attend_by_segment_keeps_one_buffer() -> None:
    """mlx-lm's gemma2 computes attention itself (soft-capped scores), not through the
    function segments are routed by: its batch keeps one buffer, a long row joining is
    copied in beside the others, and every row still decodes as if alone."""
    model = _gemma2(kv_heads=4)
    batch = RowsCache.for_model(model, "fp16")
    assert not batch.ragged
    prompts = [[5, 6, 7], [(9 * i) % 256 for i in range(700)]]
    alone = [Alone(model, "fp16", p) for p in prompts]
    for p in prompts:
        _join(batch, model, "fp16", p)
    ys = [p[-1] for p in prompts]
    for _ in range(2):
        logits = _step(batch, model, [[y] for y in ys])
        assert batch.segments == 1
        for b, y in enumerate(ys):
            assert logits_close(logits[b, 0], alone[b].feed([y])[0], "fp16"), b
        ys = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_model_whose_rows_do_not_batch_decodes_one_at_a_time(dtype: mx.Dtype) -> None:
    """gemma2 with grouped keys broadcasts a batch's (B, 1, n, columns) mask against its
    own 5-axis scores, so its rows batched are not its rows alone: the probe finds it,
    in float32 and in a 16-bit dtype (where it allows more for rounding), and the lane
    takes one row at a time instead of answering wrong."""
    model = _gemma2(kv_heads=2)
    model.set_dtype(dtype)
    with pytest.raises(Unbatchable):
        RowsCache.for_model(model, "fp16")
    assert isinstance(lane_cache(model, "fp16"), OneRow)


def test_a_16_bit_model_batches_in_segments() -> None:
    """The probe's allowance for 16-bit rounding does not cost a 16-bit model its
    segments: the demo computing in bfloat16 (the dtype a GPU keeps) batches apart."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    model = load_for_compute(resolve_model("builtin:demo"), "bfloat16").model
    for kv in ("fp16", "q8"):
        assert RowsCache.for_model(model, kv).ragged, kv

"""Joining rows prefilled together, on the packaged models: caches stacked at one offset,
one forward for all, and each row taken back out gives the logits it would get alone
(to float tolerance: batch shapes change reduction orders); the prefill cost fit, as a
table."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from seatd import prefill_rows
from seatd.engine_types import make_cache
from seatd.prefill_rows import (
    PrefillCost,
    RideCost,
    fit_cost,
    padded,
    stack,
    stackable,
    take,
    tokens_within,
    unpaced_tokens,
)
from tests.lanes import logits_close

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26],
           [30, 31, 32, 33, 34, 35, 36, 37]]


def _alone(model: Any, kv: str, prompt: list[int]) -> mx.array:
    """The logits of the prompt's last token, the rest fed alone."""
    cache = make_cache(model, kv)
    model(mx.array([prompt[:-1]]), cache=cache)
    out: mx.array = model(mx.array([prompt[-1:]]), cache=cache)[0, -1]
    return out


def test_rows_prefilled_together_answer_as_alone(lane: tuple[Any, str]) -> None:
    model, kv = lane
    # Rows 0 and 1 start cold; row 2 arrives with 3 tokens already in its own cache.
    caches = [make_cache(model, kv), make_cache(model, kv)]
    group = stack(caches)
    model(mx.array([p[:3] for p in PROMPTS[:2]]), cache=group)
    late = make_cache(model, kv)
    model(mx.array([PROMPTS[2][:3]]), cache=late)
    assert stackable(group) and stackable(late)
    group = stack([group, late])  # the late row caught up: one group of three at offset 3
    model(mx.array([p[3:6] for p in PROMPTS]), cache=group)
    # Row 1's prompt (all but its last token) is in: it leaves, the others go on.
    row1 = take(group, 1)
    group = prefill_rows.keep(group, [0, 2])
    model(mx.array([PROMPTS[0][6:7], PROMPTS[2][6:7]]), cache=group)
    row2 = take(group, 1)  # in too
    row0 = take(group, 0)
    model(mx.array([PROMPTS[0][7:9]]), cache=row0)  # the rest alone
    for prompt, cache in zip(PROMPTS, [row0, row1, row2], strict=True):
        want = _alone(model, kv, prompt)
        got = model(mx.array([prompt[-1:]]), cache=cache)[0, -1]
        assert logits_close(got, want, kv), prompt
        assert int(mx.argmax(got).item()) == int(mx.argmax(want).item())


def test_rows_at_different_offsets_do_not_stack(lane: tuple[Any, str]) -> None:
    model, kv = lane
    a, b = make_cache(model, kv), make_cache(model, kv)
    model(mx.array([PROMPTS[0][:2]]), cache=a)
    model(mx.array([PROMPTS[1][:3]]), cache=b)
    if any(hasattr(c, "offset") for c in a):
        with pytest.raises(ValueError, match="different offsets"):
            stack([a, b])


def test_other_caches_are_not_stackable() -> None:
    from mlx_lm.models.cache import RotatingKVCache

    assert not stackable([RotatingKVCache(max_size=8)])  # type: ignore[no-untyped-call]
    assert not stackable([object()])


def _cost(tokens: int, context: float) -> float:
    """A made-up machine: 20 ms fixed, 1 ms a token, 1 us a token per context token."""
    return 0.020 + tokens * (0.001 + 1e-6 * context)


WITH_CONTEXT = [(t, c, _cost(t, c)) for t, c in [(16, 100), (16, 1400), (64, 500), (32, 800)]]


@pytest.mark.parametrize("steps, want", [
    ([], None),
    ([(16, 8.0, 0.032)], (0.0, 0.002, 0.0)),  # one step: all of it per token (too much)
    ([(16, 0.0, 0.030), (64, 0.0, 0.054), (128, 0.0, 0.086)], (0.022, 0.0005, 0.0)),
    (WITH_CONTEXT, (0.020, 0.001, 1e-6)),
    ([(16, 0.0, 0.050), (64, 0.0, 0.040)], (0.0, 0.09 / 80, 0.0)),  # cost falls: mean
    ([(16, 0.0, 0.001), (64, 0.0, 0.040)], (0.0, 0.041 / 80, 0.0)),  # negative fixed: mean
], ids=["none", "one", "no-context", "context", "falling", "negative"])
def test_fit_cost(steps: list[tuple[int, float, float]],
                  want: tuple[float, float, float] | None) -> None:
    got = fit_cost(steps)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("budget_s, context, rows", [
    (0.052, 0, 1), (0.052, 1400, 1), (0.100, 300, 4), (0.400, 50, 8)])
def test_tokens_within_the_time(budget_s: float, context: int, rows: int) -> None:
    """The most tokens per row whose step fits a budget, by the fitted cost: arithmetic
    on the cost model fed the samples of WITH_CONTEXT, with no clock read anywhere."""
    cost = PrefillCost()
    for tokens, ctx, s in WITH_CONTEXT:
        cost.observe(tokens, ctx, s)
    got = cost.tokens_within(budget_s, context, rows, 1)
    assert got is not None

    def modelled_step_s(t: int) -> float:  # the samples' own law: rows * t tokens, half
        return 0.020 + rows * t * (0.001 + 1e-6 * (context + t / 2))  # a piece further in

    # the largest count the model says fits: one more would not
    assert modelled_step_s(got) <= budget_s + 1e-9 < modelled_step_s(got + 1)


def test_tokens_within_a_time_below_the_fixed_part_is_the_floor() -> None:
    cost = PrefillCost()
    assert cost.tokens_within(0.05, 0, 1, 8) is None  # nothing measured yet
    for tokens, ctx, s in WITH_CONTEXT:
        cost.observe(tokens, ctx, s)
    assert cost.tokens_within(0.01, 0, 1, 8) == 8


def test_big_steps_stay_in_the_fit() -> None:
    """Forty small steps alike cannot separate the fixed part from the per-token one;
    the big steps seen before them still can."""
    cost = PrefillCost()
    for tokens, ctx in [(512, 256), (448, 224), (256, 128)]:
        cost.observe(tokens, ctx, _cost(tokens, ctx))
    for i in range(40):
        cost.observe(8, 600 + i, _cost(8, 600 + i))
    assert cost.fit() == pytest.approx((0.020, 0.001, 1e-6), rel=1e-6, abs=1e-9)


def test_riding_tokens_by_their_measured_cost() -> None:
    """Seconds per riding token, a moving average; a step sized by it (rounded up)
    converges on the count whose fixed and per-token parts fill the time."""
    ride = RideCost()
    assert ride.tokens_within(0.03) is None  # nothing measured yet
    ride.observe(10, 0.02)
    assert ride.tokens_within(0.03) == 15
    ride.observe(0, 1.0)  # nothing rode: nothing learnt
    assert ride.rate == pytest.approx(0.002)
    ride.observe(10, 1.0)  # one step held up for a second moves it by RIDE_ALPHA
    assert ride.rate == pytest.approx(0.7 * 0.002 + 0.3 * 0.1)

    def step_s(tokens: int) -> float:  # riding's own fixed part and a cost per token
        return 0.02 + 0.003 * tokens

    ride = RideCost()
    tokens = 1
    for _ in range(40):
        ride.observe(tokens, step_s(tokens))
        tokens = ride.tokens_within(0.035) or 0
    assert tokens == 5  # (35 - 20) / 3, where one row at a time would stay at one


@pytest.mark.parametrize("fit, seconds, context, rows, floor, want", [
    ((0.02, 0.001, 0.0), 0.0305, 0, 1, 0, 10),
    ((0.02, 0.001, 0.0), 0.01, 0, 1, 8, 8),  # below the fixed part: the floor
    ((0.0, 0.001, 0.0), 0.0305, 0, 3, 0, 10),  # three rows share the time
    ((0.0, 0.0, 0.0), 0.03, 0, 1, 2, 2),  # a fit that costs nothing per token: the floor
    ((0.0, 0.0, 1e-6), 0.002, 1000, 1, 0, 1),  # per context token only
], ids=["fixed", "below-fixed", "rows", "free", "context-only"])
def test_tokens_within_a_fit(fit: tuple[float, float, float], seconds: float,
                             context: int, rows: int, floor: int, want: int) -> None:
    assert tokens_within(fit, seconds, context, rows, floor) == want


# fit: (fixed s, s per token, s per token and context token)
LAUNCH = (0.005, 1e-6, 0.0)  # a forward's fixed part is most of it (a GPU's small steps)
COMPUTE = (0.001, 1e-4, 0.0)  # every token costs (a CPU's big steps)


@pytest.mark.parametrize("ends, limit, fit, context, want", [
    ([109, 111, 112], 512, None, 0, 109),  # nothing measured: the nearest end
    ([109, 111, 112], 512, LAUNCH, 0, 112),  # two forwards saved for 4 filler tokens
    ([109, 111, 112], 110, LAUNCH, 0, 109),  # the step's limit stops it
    ([109, 111, 112], 111, LAUNCH, 0, 111),  # as far as the limit allows
    ([109, 111, 112], 512, COMPUTE, 0, 112),  # 4 tokens cost less than two forwards
    ([109, 329, 351], 512, COMPUTE, 0, 109),  # 220 filler tokens cost more than a forward
    ([109, 329, 351], 512, LAUNCH, 0, 351),  # where the forward is what costs
    ([50, 50, 400], 512, (0.002, 1e-5, 0.0), 0, 50),  # one row far behind: its own forwards
    ([200], 512, LAUNCH, 0, 200),  # one row: nothing to pad
    ([0, 5], 512, LAUNCH, 0, 0),  # a row already in: it leaves first
    ([10, 20], 512, (0.001, 0.0, 1e-6), 4000, 10),  # filler deep in a prompt attends to it all
], ids=["unmeasured", "launch-bound", "limit-below", "limit-between", "few-filler",
        "much-filler", "launch-much", "one-behind", "alone", "ready", "context"])
def test_padded_prefill_takes_a_forward_past_the_nearer_ends_where_it_saves(
        ends: list[int], limit: int, fit: tuple[float, float, float] | None,
        context: int, want: int) -> None:
    assert padded(ends, limit, fit, context) == want


@pytest.mark.parametrize("fit, rows, context, want", [
    (None, 13, 0, 39),  # nothing measured: a chunk in all
    (None, 100, 0, 8),  # ... at least the floor a row
    (COMPUTE, 13, 0, 39),  # 90 tokens outweigh the fixed part 9 to 1: a chunk in all already
    (COMPUTE, 1, 0, 512),  # one row: a chunk
    ((0.0035, 5e-6, 0.0), 13, 0, 485),  # launch-bound: 6,300 tokens in all
    ((0.0035, 5e-6, 0.0), 4, 0, 512),  # ... within a chunk a row
    ((0.0035, 0.0, 0.0), 13, 0, 512),  # no cost a token measured: a chunk a row
    ((0.0035, 0.0, 1e-8), 13, 1000, 243),  # at 1,000 tokens in a token costs 1e-5 s: 3,150
], ids=["unmeasured", "floor", "compute", "compute-alone", "launch", "launch-chunk",
        "free", "context"])
def test_an_unpaced_step_amortises_its_fixed_part(
        fit: tuple[float, float, float] | None, rows: int, context: int, want: int) -> None:
    got = unpaced_tokens(fit, rows, context, 512, 8)
    assert got == want
    assert max(8, 512 // rows) <= got <= 512


@pytest.mark.parametrize(("prompt_len", "cuts", "point"), [
    (120, (10, 117), 117),  # a chat: its answer's header (3 tokens) after the last cut
    (120, (10, 116), 116),  # four tokens after it (Llama 3's header)
    (120, (10, 115), 119),  # five: prefilled to its end, as every prompt was
    (120, (), 119),  # no turn: a completion prompt
    (120, (10,), 119),  # its last cut far from its end
    (120, (10, 119), 119),  # a cut at its last token
    (515, (10, 511), 514),  # a chunk-grid boundary (512) past its last cut
    (514, (10, 512), 512),  # the last cut on the grid itself
    (120, (10, 117, 130), 117),  # a cut past the prompt counts for nothing
])
def test_a_row_joins_at_its_last_cut_where_only_its_answers_header_follows(
        prompt_len: int, cuts: tuple[int, ...], point: int) -> None:
    from seatd.prefill_rows import join_point

    assert join_point(prompt_len, cuts, 512) == point

"""Float flips: where two answers part, how many tokens were compared, the top-two gap,
which answer position each logits row scores, and the report's rows and figures."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from sanctum.bench.flips import (
    FlipRow,
    LogitsTap,
    answer_positions,
    compared_tokens,
    first_difference,
    groups,
    headline,
    per_thousand,
    section,
    stored_rows,
    summarize_cases,
    top2_margin,
)
from sanctum.bench.report import render
from sanctum.bench.results import ArmInfo, Run


@pytest.mark.parametrize(("a", "b", "first", "compared"), [
    ([], [], None, 0),
    ([1, 2, 3], [1, 2, 3], None, 3),
    ([1, 2, 3], [1, 9, 3], 1, 2),          # the differing position is compared too
    ([5, 2, 3], [4, 2, 3], 0, 1),
    ([1, 2], [1, 2, 3], 2, 3),             # one stopped (end of text) where the other drew
    ([1, 2, 3, 4], [1, 2], 2, 3),
    ([7] * 256, [7] * 255 + [8], 255, 256),
])
def test_first_difference_and_tokens_compared(a: list[int], b: list[int], first: int | None,
                                              compared: int) -> None:
    assert first_difference(a, b) == first
    assert first_difference(b, a) == first
    assert compared_tokens(a, b) == compared


@pytest.mark.parametrize(("flips", "compared", "want"), [
    (0, 0, 0.0), (0, 1280, 0.0), (1, 1000, 1.0), (2, 500, 4.0), (1, 250, 4.0)])
def test_per_thousand(flips: int, compared: int, want: float) -> None:
    assert per_thousand(flips, compared) == pytest.approx(want)


@pytest.mark.parametrize(("scores", "want"), [
    ([1.0, 3.0, 2.5], 0.5),
    ([3.0, 3.0, 1.0], 0.0),                               # an exact tie
    ([-math.inf, 2.0, -math.inf, 1.25], 0.75),            # filtered entries do not count
    ([-math.inf, 2.0, -math.inf], None),                  # one token left: nothing to flip
    ([0.1, 0.1000001, -5.0], pytest.approx(1e-7, abs=1e-8)),
])
def test_top2_margin(scores: list[float], want: Any) -> None:
    assert top2_margin(np.array(scores, dtype=np.float64)) == want


@pytest.mark.parametrize(("offset", "width", "n_prompt", "want"), [
    (9, 1, 10, [(0, 0)]),                         # the plain path's first step
    (14, 1, 10, [(0, 5)]),
    (12, 4, 10, [(0, 3), (1, 4), (2, 5), (3, 6)]),  # a verify block of depth 3
    (0, 9, 10, []),                               # prefill: all of the prompt but its last
    (0, 10, 10, [(9, 0)]),                        # a forward of the whole prompt
])
def test_answer_positions(offset: int, width: int, n_prompt: int,
                          want: list[tuple[int, int]]) -> None:
    assert answer_positions(offset, width, n_prompt) == want


class _Cache:
    def __init__(self) -> None:
        self.offset = 0


class _Model:
    """A stand-in target: logits row j of a forward at offset o is filled with o + j, so a
    test can tell which forward scored a position; `trim` rolls back like a rejection."""

    vocab = 4
    some_attribute = "kept"

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        c = cache[0]
        width = x.shape[1]
        rows = [mx.full((self.vocab,), float(c.offset + j)) for j in range(width)]
        c.offset += width
        return mx.stack(rows)[None]


def test_logits_tap_keeps_the_last_row_scored_for_each_position() -> None:
    """A rejected draft's rows are scored again by the next forward: the later row wins;
    the model's attributes show through the tap."""
    n_prompt = 3
    tap = LogitsTap(_Model(), n_prompt)
    cache = [_Cache()]
    tap(mx.zeros((1, 2), dtype=mx.uint32), cache=cache)  # prefill: prompt[:-1]
    assert tap.rows == {}
    tap(mx.zeros((1, 4), dtype=mx.uint32), cache=cache)  # verify at offset 2: positions 0..3
    assert sorted(tap.rows) == [0, 1, 2, 3]
    cache[0].offset -= 2  # kept one draft: positions 2 and 3 were scored after a rejection
    tap(mx.zeros((1, 3), dtype=mx.uint32), cache=cache)  # offset 4: positions 2..4
    width, row = tap.row(2)
    assert width == 3 and row.tolist() == [4.0] * 4
    assert tap.row(1)[1].tolist() == [3.0] * 4 and tap.row(1)[0] == 4
    assert tap.some_attribute == "kept"


def _row(model: str, workload: str, rule: str, t: float, config: str, first: int | None,
         compared: int, **kw: Any) -> FlipRow:
    return FlipRow(model, workload, rule, t, config, compared, compared, first, compared, 1.5,
                   1e-5, 0.03, 4, **kw)


ROWS = [
    _row("builtin:demo", "code-short", "greedy", 0.0, "d3", None, 256),
    _row("builtin:demo", "prose", "greedy", 0.0, "d3", 99, 100, width=4, logit_diff=1.2e-5,
         score_diff=1.2e-5, margin_plain=3e-6, margin_spec=4e-6, token_plain=5, token_spec=6),
    _row("builtin:demo", "code-short", "keyed", 0.7, "d3", None, 200),
]


def test_groups_and_summaries() -> None:
    """Rows group by model, rule and config; flips per 1,000 pool the tokens compared."""
    got = groups(ROWS)
    assert [k for k, _ in got] == [("builtin:demo", "greedy t=0", "d3"),
                                   ("builtin:demo", "keyed t=0.7", "d3")]
    assert summarize_cases(got[0][1]) == (1, 356, pytest.approx(1000 / 356))
    assert summarize_cases(got[1][1]) == (0, 200, 0.0)


def _flips_run() -> Run:
    import msgspec

    return Run("f1", "flips", "Speculative against plain answers", "plain",
               [ArmInfo("plain", "p"), ArmInfo("d3", "d")], {}, 1, 0, 0,
               {"date": "d", "model": "builtin:demo"}, [], ["a note"],
               extra={"flips": msgspec.to_builtins(ROWS), "tokens": 256})


def test_flips_section_and_headline_from_stored_rows() -> None:
    """The stored rows come back typed; the section names the flip and explains it from
    the widths; the summary table gets one row per model, rule and config."""
    run = _flips_run()
    assert stored_rows(run) == ROWS
    assert headline(run) == [
        ("flips per 1,000 tokens, demo greedy t=0 d3", "2.8 (1 in 356 tokens)"),
        ("flips per 1,000 tokens, demo keyed t=0.7 d3", "0 (0 in 200 tokens; below 15 at 95%)")]
    text = "\n".join(section(run, "8. Float flips"))
    assert "| demo | prose | greedy t=0 | d3 | 100 / 100 | 1.50 | 99 | 100 |" in text
    assert "width 4, logit difference 1.2e-05, gap plain 3e-06 / speculative 4e-06" in text
    assert ("| builtin:demo | greedy t=0 | d3 | 2 | 1 | 356 | 2.8 (1 in 356 tokens) | 1e-05 "
            "| 0.03 | 3,000x |") in text


def test_report_renders_flips_without_interleaving() -> None:
    """A flips run has no interleaved samples and is not refused for it."""
    text = render({"flips": _flips_run()}, None, plot=lambda run, path: False)
    assert "## 8. Float flips: speculative against plain answers" in text
    assert "Refused" not in text
    assert ("| 8. Float flips: speculative against plain answers | flips per 1,000 tokens, "
            "demo keyed t=0.7 d3 | 0 (0 in 200 tokens; below 15 at 95%) | - |") in text

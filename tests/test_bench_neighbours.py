"""Neighbours: which cases share a batch, tokens until the first difference, the totals
per group, mean rows per forward, and the report's rows and figures (no model loaded);
and the latecomers arm on the demo."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sanctum.bench.neighbours import (
    NeighbourRow,
    batches,
    fill_rows,
    groups,
    headline,
    mean_rows,
    section,
    stored_rows,
    totals,
    until_first,
)
from sanctum.bench.report import render
from sanctum.bench.results import ArmInfo, Run
from tests.lanes import rows_round_apart


@pytest.mark.parametrize(("n", "size", "want"), [
    (0, 8, []),
    (1, 4, [[0, 0, 0, 0]]),                        # one case: four requests of it
    (3, 8, [[0, 1, 2, 0, 1, 2, 0, 1]]),            # fewer cases than rows: cyclic fill
    (8, 8, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (10, 8, [list(range(8)), list(range(2, 10))]),  # the last window overlaps
    (16, 8, [list(range(8)), list(range(8, 16))]),
    (5, 2, [[0, 1], [2, 3], [3, 4]]),
])
def test_batches_cover_every_case_in_windows_of_the_batch_size(
        n: int, size: int, want: list[list[int]]) -> None:
    got = batches(n, size)
    assert got == want
    assert all(len(w) == size for w in got)
    assert {i for w in got for i in w} == set(range(n))


@pytest.mark.parametrize(("others", "length", "count", "want"), [
    ([[1, 2, 3, 4]], 2, 3, [[1, 2], [1, 2], [1, 2]]),         # cut; reused in turn
    ([[1, 2], [7, 8, 9]], 5, 2, [[1, 2, 1, 2, 1], [7, 8, 9, 7, 8]]),  # repeated to length
    ([[]], 2, 1, [[0, 0]]),                                    # an empty one: padding
    ([[5], [6]], 1, 3, [[5], [6], [5]]),
])
def test_fill_rows_gives_rows_of_one_length(others: list[list[int]], length: int, count: int,
                                            want: list[list[int]]) -> None:
    assert fill_rows(others, length, count) == want


def _row(workload: str, rule: str, config: str, arm: str, first: int | None, compared: int,
         **kw: Any) -> NeighbourRow:
    t = 0.0 if rule == "greedy" else 0.7
    return NeighbourRow("builtin:demo", workload, rule, t, config, arm, 0, ["prose greedy"],
                        compared, compared, first, compared, **kw)


ROWS = [
    _row("code-short", "greedy", "plain", "batched", None, 128, rows_per_step=7.5),
    _row("prose", "greedy", "plain", "batched", 40, 41, token_alone=5, token_batched=6,
         rows_per_step=6.5),
    _row("rename", "greedy", "plain", "batched", 10, 11, rows_per_step=7.0),
    _row("prose", "keyed", "plain", "batched", None, 128, rows_per_step=8.0),
    _row("prose", "greedy", "d3", "solo", None, 100, state_alone="accelerated",
         state_batched="accelerated", verifies_alone=30, verifies_batched=30,
         accept_alone=2.25, accept_batched=2.25, rows_per_step=1.0),
]


@pytest.mark.parametrize(("rows", "want"), [
    ([], None),
    (ROWS[:1], None),                      # equal answers: nothing to count
    (ROWS[:2], (40.0, 40)),
    (ROWS[:3], (25.0, 10)),                # median of 40 and 10
])
def test_until_first_counts_only_the_answers_that_differ(
        rows: list[NeighbourRow], want: tuple[float, int] | None) -> None:
    assert until_first(rows) == want


def test_groups_and_totals() -> None:
    """Rows group by model, rule, config and arm; flips per 1,000 pool the tokens compared
    (an answer that parted counts up to and including its first difference)."""
    got = groups(ROWS)
    assert [k for k, _ in got] == [("builtin:demo", "greedy t=0", "plain", "batched"),
                                   ("builtin:demo", "keyed t=0.7", "plain", "batched"),
                                   ("builtin:demo", "greedy t=0", "d3", "solo")]
    assert totals(got[0][1]) == (2, 180, pytest.approx(2000 / 180))
    assert totals(got[1][1]) == (0, 128, 0.0)


@pytest.mark.parametrize(("sizes", "want"), [
    ({}, 0.0), ({1: 10}, 1.0), ({8: 30, 4: 10}, 7.0), ({1: 1, 2: 1, 3: 1}, 2.0)])
def test_mean_rows(sizes: dict[int, int], want: float) -> None:
    assert mean_rows(sizes) == pytest.approx(want)


def _run() -> Run:
    return Run("n1", "neighbours", "A seeded answer alone against batched", "alone",
               [ArmInfo("alone", "a"), ArmInfo("batched", "b")], {}, 1, 0, 0,
               {"date": "d", "model": "builtin:demo"}, [], ["a note"],
               extra={"neighbours": msgspec.to_builtins(ROWS), "tokens": 128,
                      "shape_logit_diff": {"builtin:demo": 1.24e-5}})


def test_section_and_headline_from_stored_rows() -> None:
    """The stored rows come back typed; the summary table has one row per group with the
    tokens until the first difference; each answer has its own row."""
    run = _run()
    assert stored_rows(run) == ROWS
    assert headline(run)[0] == ("flips per 1,000 tokens, alone against batched, demo greedy "
                                "t=0 plain", "11 (2 in 180 tokens)")
    assert headline(run)[2] == ("flips per 1,000 tokens, alone against solo, demo greedy t=0 "
                                "d3", "0 (0 in 100 tokens; below 30 at 95%)")
    text = "\n".join(section(run, "11. Neighbours"))
    assert ("| builtin:demo | greedy t=0 | plain | batched | 3 | 2 | 180 "
            "| 11 (2 in 180 tokens) | 25 / 10 | 7.00 | - |") in text
    assert "| builtin:demo | greedy t=0 | d3 | solo | 1 | 0 | 100 " in text
    assert ("| demo | prose | greedy t=0 | plain | batched | 0 | 6.50 | 41 / 41 | 40 | 41 "
            "| 5 / 6 |") in text
    assert "accelerated 30 x 2.25 / accelerated 30 x 2.25" in text
    assert "differs by at most 1.2e-05 (demo) in any logit" in text


def test_report_renders_neighbours_without_interleaving() -> None:
    """A neighbours run has no interleaved samples and is not refused for it."""
    text = render({"neighbours": _run()}, None, plot=lambda run, path: False)
    assert "## 11. Neighbours: a seeded answer alone against batched with 7 others" in text
    assert "Refused" not in text
    assert ("| 11. Neighbours: a seeded answer alone against batched with 7 others | flips "
            "per 1,000 tokens, alone against batched, demo keyed t=0.7 plain "
            "| 0 (0 in 128 tokens; below 23 at 95%) | - |") in text


@rows_round_apart
def test_latecomers_join_a_busy_batch_and_ride_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latecomers arm submits each row once the one before it decodes: every row but
    the first joins rows already decoding, at their pace, and rides their steps (the
    demo's attention takes riders); each answer, seeded and keyed, is its own alone.
    Whether a chunk rides or takes a forward of its own is the engine's measured ride and
    prefill costs (`seatd.batch_policy.ride_tokens`), this machine's load: here every
    chunk that can ride does, as before any ride was measured (a 13x skew between the
    two once made the second latecomer prefill on its own)."""
    from sanctum.bench.flips import Case
    from sanctum.bench.neighbours import decode_rows
    from seatd import batch
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    loaded = load_for_compute(resolve_model("builtin:demo"))
    tok = loaded.tokenizer
    text = open(batch.__file__).read()
    cases = [Case("demo", f"w{i}", tok.encode(text[1000 * i : 1000 * i + 600]),
                  0.7 if i % 2 else 0.0, 0.9, 20, 1 if i % 2 else None) for i in range(3)]
    rode: list[str] = []
    real = batch.Engine._ridden

    def ridden(self: Any, aboard: Any) -> None:
        rode.append(aboard.group.rows[0].rid)
        real(self, aboard)

    monkeypatch.setattr(batch.Engine, "_ridden", ridden)
    measured = batch.ride_tokens
    monkeypatch.setattr(batch, "ride_tokens", lambda ride, own, limit, n, first:
                        measured(None, own, limit, n, first))
    late, _ = decode_rows(loaded, None, cases, "plain", 24, late=True)
    assert set(rode) == {"n1", "n2"}, rode
    for case, answer in zip(cases, late, strict=True):
        (alone,), _ = decode_rows(loaded, None, [case], "plain", 24)
        assert answer.ids == alone.ids, case.workload

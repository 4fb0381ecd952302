"""Acceptance figures for the speculation comparison: the seat's counters and mlx-lm's
speculative stream, read the same way (accepted draft tokens per verify)."""

from __future__ import annotations

import pytest

from sanctum.bench.arms import acceptance_figures, counter_acceptance, stream_acceptance


@pytest.mark.parametrize(("flags", "want"), [
    ([], {}),
    ([False, False], {"accept_len": 0.0}),
    # verify 1: two drafts accepted, then the target's token; verify 2: none accepted
    ([True, True, False, False], {"accept_len": 1.0, "accept_p1": 0.5, "accept_p2": 0.5}),
    ([True, False, True, True, True, False],
     {"accept_len": 2.0, "accept_p1": 1.0, "accept_p2": 0.5, "accept_p3": 0.5}),
    # stopped at max_tokens inside the second verify's accepted run: still a verify
    ([True, False, True, True], {"accept_len": 1.5, "accept_p1": 1.0, "accept_p2": 0.5}),
])
def test_stream_acceptance(flags: list[bool], want: dict[str, float]) -> None:
    assert stream_acceptance(flags) == want


@pytest.mark.parametrize(("before", "after", "want"), [
    ({}, {}, {}),
    ({"spec_drafts": 3, "spec_accepted_tokens": 5, "spec_accepted_per_position": [3, 2]},
     {"spec_drafts": 7, "spec_accepted_tokens": 11, "spec_accepted_per_position": [6, 4, 1]},
     {"accept_len": 1.5, "accept_p1": 0.75, "accept_p2": 0.5, "accept_p3": 0.25}),
    ({"spec_drafts": 2}, {"spec_drafts": 2}, {}),
])
def test_counter_acceptance(before: dict, after: dict, want: dict[str, float]) -> None:
    assert counter_acceptance(before, after) == want


def test_acceptance_figures_no_verifies() -> None:
    assert acceptance_figures(0, 0, []) == {}

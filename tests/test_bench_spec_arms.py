"""Acceptance figures for the speculation comparison: the seat's counters and mlx-lm's
speculative stream, read the same way (accepted draft tokens per verify)."""

from __future__ import annotations

import pytest

from sanctum.bench.arms import (
    acceptance_figures,
    counter_acceptance,
    drafter_share,
    predicted_rate,
    round_figures,
    stream_acceptance,
)


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


@pytest.mark.parametrize(("before", "after", "want"), [
    ({}, {"spec_drafts_by_drafter": {"model": 3, "lookup": 1}}, {"lookup_share": 0.25}),
    ({"spec_drafts_by_drafter": {"model": 3}},
     {"spec_drafts_by_drafter": {"model": 3, "lookup": 2}}, {"lookup_share": 1.0}),
    ({"spec_drafts_by_drafter": {"model": 3}}, {"spec_drafts_by_drafter": {"model": 3}}, {}),
])
def test_drafter_share(before: dict, after: dict, want: dict[str, float]) -> None:
    assert drafter_share(before, after) == want


def test_predicted_rate_from_the_seats_terms() -> None:
    """(1 + accepted drafts per round) over the drafting and verify time of a round; the
    host's share of the whole round beside it."""
    terms = {"draft_3": 24000, "verify_w4": 44000, "host": 2000}
    got = predicted_rate(terms, 3, 2.5)
    assert got["predicted_tps"] == pytest.approx(3.5 / 0.068)
    assert got["host_share"] == pytest.approx(2 / 70)
    assert predicted_rate(terms, 4, 2.5) == {}  # depth 4 was never measured
    assert predicted_rate({}, 3, 2.5) == {}


@pytest.mark.parametrize(("before", "after", "tokens", "want"), [
    ({}, {}, None, {}),
    ({"spec_drafts": 4}, {"spec_drafts": 20}, 64.0, {"rounds_per_token": 0.25}),
    ({"spec_drafts": 4}, {"spec_drafts": 4, "spec_cost_us": {"plain": 1400, "verify_w2": 1700,
                                                            "draft_1": 300}},
     32.0, {"rounds_per_token": 0.0, "cost_plain_us": 1400.0, "cost_verify_w2_us": 1700.0}),
])
def test_round_figures(before: dict, after: dict, tokens: float | None,
                       want: dict[str, float]) -> None:
    assert round_figures(before, after, tokens) == want


def test_acceptance_figures_no_verifies() -> None:
    assert acceptance_figures(0, 0, []) == {}


def test_verify_round_arm_times_rounds_and_rollbacks() -> None:
    """The rollback comparison's arms on the hybrid demo: both time their rounds; only the
    recording arm has a rollback to time."""
    from sanctum.bench import arms as A
    from sanctum.bench.workloads import Workload
    from shared.builtin import resolve_model

    w = Workload("w", "a prompt", "completion", prompt="def f(x):\n    return x + 1\n" * 4)
    path = resolve_model("builtin:demo-hybrid")
    rec = A.VerifyRoundArm(path, {"w": w}, width=4, keep=2, rollback=True, rounds=3)
    plain = A.VerifyRoundArm(path, {"w": w}, width=4, keep=2, rollback=False, rounds=3)
    a, b = rec("w"), plain("w")
    assert a["round_s"] > 0 and a["rollback_s"] > 0 and a["rollback_s"] < a["round_s"]
    assert b["round_s"] > 0 and "rollback_s" not in b

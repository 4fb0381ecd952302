"""The load test's bounds and its summary of what the clients saw."""

from __future__ import annotations

import pytest

from sanctum.bench.load import Outcome, check_bounds, summarize_load


def test_summary_counts_served_errors_overload_and_hangs() -> None:
    """Served requests give the latency figures; overload without Retry-After is counted."""
    outcomes = [Outcome(200, 0.1, False), Outcome(200, 0.3, False),
                Outcome(503, 0.01, True), Outcome(429, 0.01, False),
                Outcome(0, 120.0, False, hung=True)]
    s = summarize_load(outcomes, seconds=2.0)
    assert s["served"] == 2 and s["requests"] == 5
    assert s["served_per_s"] == 1.0
    assert s["errors"] == {"503": 1, "429": 1, "0": 1}
    assert s["overload_answers"] == 2 and s["overload_without_retry_after"] == 1
    assert s["hangs"] == 1
    assert s["p50_s"] == pytest.approx(0.2)


def test_nothing_served_has_no_latency() -> None:
    s = summarize_load([Outcome(503, 0.01, True)], 1.0)
    assert s["p99_s"] is None and s["served"] == 0


@pytest.mark.parametrize(("url", "clients", "seconds"), [
    ("http://10.0.0.5:8800", 4, 10),     # not loopback
    ("http://example.com:8800", 4, 10),
    ("http://127.0.0.1:8800", 0, 10),    # no clients
    ("http://127.0.0.1:8800", 65, 10),   # too many
    ("http://127.0.0.1:8800", 4, 301),   # too long
])
def test_out_of_bounds_load_is_refused(url: str, clients: int, seconds: float) -> None:
    with pytest.raises(SystemExit):
        check_bounds(url, clients, seconds)


def test_loopback_within_bounds_is_accepted() -> None:
    check_bounds("http://127.0.0.1:8800", 16, 20)
    check_bounds("http://localhost:9", 1, 0.5)

"""seatd's own totals (restarts, memory_restarts) survive a restart of seatd itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from seatd import ledger
from seatd.states import OverBudget, SeatState, State
from seatd.supervisor import Supervisor
from shared.config import parse_config

CONFIG = """
[[seat]]
name = "demo"
model = "builtin:demo"

[[route]]
model = "demo"
ladder = ["demo"]
"""


def supervisor(state: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    monkeypatch.setenv("SANCTUM_STATE_DIR", str(state))
    return Supervisor(parse_config(CONFIG), None)


def test_totals_are_reloaded_and_only_grow(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A new seatd starts from the saved totals, and a recycle is saved at once."""
    ledger.save(ledger.path_for(tmp_path, "demo"), ledger.Totals(restarts=3, memory_restarts=1))
    first = supervisor(tmp_path, monkeypatch)
    try:
        seat = first.seats["demo"]
        assert (seat.state.restarts, seat.state.memory_restarts) == (3, 1)
        seat.state = SeatState(State.BUSY, pid=None, restarts=3, memory_restarts=1)
        first.feed(seat, OverBudget("memory: rss 9 MB over budget 1 MB"))
        assert seat.state.state is State.STOPPING
        counted = first.counters().seats["demo"]
        assert counted["memory_restarts"] == 2 and counted["restarts"] == 3
    finally:
        first.beat_ctx.term()
    second = supervisor(tmp_path, monkeypatch)
    try:
        assert second.seats["demo"].state.memory_restarts == 2
        assert second.seats["demo"].state.restarts == 3
    finally:
        second.beat_ctx.term()

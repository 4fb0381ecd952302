"""seatd's persisted per-seat totals."""

from pathlib import Path

from seatd import ledger


def test_round_trip_and_atomic_file(tmp_path: Path) -> None:
    """Saved totals load back, and no temporary file is left beside them."""
    path = ledger.path_for(tmp_path, "brain")
    ledger.save(path, ledger.Totals(restarts=4, memory_restarts=2))
    assert ledger.load(path) == ledger.Totals(4, 2)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_missing_or_torn_file_starts_from_zero(tmp_path: Path) -> None:
    """No file, a torn file or a foreign file gives zeros instead of an error."""
    path = tmp_path / "x.json"
    assert ledger.load(path) == ledger.Totals()
    for text in ("{\"restarts\": ", "[1, 2]", "{\"restarts\": \"many\"}"):
        path.write_text(text)
        assert ledger.load(path) == ledger.Totals()

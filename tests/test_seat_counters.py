"""A seat's counters: atomic persistence, incarnations, refusal statistics."""

from pathlib import Path

from seatd.counters import REFUSED_SAMPLE, SeatCounters


def test_counters_survive_a_restart_and_never_go_backwards(tmp_path: Path) -> None:
    """A new incarnation starts from the saved totals, one incarnation later."""
    path = tmp_path / "counters-brain.json"
    first = SeatCounters("brain", path)
    assert first.incarnation == 1
    first.inc("served", lane="sync/fp16")
    first.inc("served", lane="stream/q8")
    first.inc("rejected", label="413")
    first.persist()
    second = SeatCounters("brain", path)
    assert second.incarnation == 2
    assert second.served == 2
    assert second.snapshot()["rejected"] == {"413": 1}
    assert second.snapshot()["lanes"]["stream/q8"]["served"] == 1
    assert not path.with_suffix(".tmp").exists()


def test_torn_file_starts_over_instead_of_crashing(tmp_path: Path) -> None:
    """A corrupt counters file is reported and ignored; the seat still starts."""
    path = tmp_path / "c.json"
    path.write_text("{not json")
    assert SeatCounters("s", path).served == 0


def test_refused_prompt_statistics(tmp_path: Path) -> None:
    """rejected{413} is shown with the count, median and maximum refused prompt length."""
    c = SeatCounters("s", tmp_path / "c.json")
    for n in (18500, 17000, 30000):
        c.inc("rejected", label="413")
        c.refused(n)
    c.persist()
    again = SeatCounters("s", tmp_path / "c.json")
    assert again.snapshot()["refused_prompts"] == {"count": 3, "median": 18500, "max": 30000}


def test_refused_sample_is_bounded(tmp_path: Path) -> None:
    """The sample behind the median is bounded; the count stays exact."""
    c = SeatCounters("s", None)
    for n in range(REFUSED_SAMPLE + 100):
        c.inc("rejected", label="413")
        c.refused(n)
    assert len(c.refused_sample) == REFUSED_SAMPLE
    assert c.snapshot()["refused_prompts"]["count"] == REFUSED_SAMPLE + 100

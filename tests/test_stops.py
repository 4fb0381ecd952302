"""Stop strings: what is emitted, held back or cut, as a table."""

import pytest

from seatd.stops import scan_stops

CASES = [
    # pending, stops, emit, hold, stopped
    ("hello", (), "hello", "", False),
    ("hello", ("xyz",), "hello", "", False),
    ("hello x", ("xyz",), "hello ", "x", False),
    ("hello xy", ("xyz",), "hello ", "xy", False),
    ("hello xyz world", ("xyz",), "hello ", "", True),
    ("a\n\nb", ("\n\n",), "a", "", True),
    ("ab", ("b", "ab"), "", "", True),  # earliest match wins
    ("abc", ("cd", "bcx"), "a", "bc", False),  # longest possible prefix held
    ("", ("x",), "", "", False),
    ("ééé", ("é!",), "éé", "é", False),  # multi-byte characters are whole characters
]


@pytest.mark.parametrize(("pending", "stops", "emit", "hold", "stopped"), CASES)
def test_scan_stops(pending: str, stops: tuple[str, ...], emit: str, hold: str,
                    stopped: bool) -> None:
    """Text that could start a stop string is held; a match cuts at its start."""
    assert scan_stops(pending, stops) == (emit, hold, stopped)


def test_pieces_never_leak_a_stop_split_across_chunks() -> None:
    """Feeding a stream piece by piece never emits any part of a stop string."""
    text = "def f():\n    return 1\n\nclass A: pass"
    for cut in range(1, 6):
        pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
        out, pending, stopped = "", "", False
        for piece in pieces:
            now, pending, stopped = scan_stops(pending + piece, ("\n\n",))
            out += now
            if stopped:
                break
        assert stopped
        assert out == "def f():\n    return 1"


@pytest.mark.parametrize(("pending", "stops", "want"), [
    ("ab\n\ncd", ["\n\n", "cd"], "\n\n"), ("abcd", ["cd", "bc"], "bc"),
    ("abcd", ["bcd", "bc"], "bcd"), ("abcd", ["x"], None), ("abcd", [], None),
    ("abcd", ["", "d"], "d"),
])
def test_first_stop_names_the_stop_scan_stops_cut_at(pending: str, stops: list[str],
                                                       want: str | None) -> None:
    from seatd.stops import first_stop

    assert first_stop(pending, stops) == want
    if want is not None:
        assert scan_stops(pending, stops)[0] == pending[:pending.find(want)]

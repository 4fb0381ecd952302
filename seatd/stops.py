"""Stop strings on a text stream: a pure step with no model in sight.

Text that might be the start of a stop string is held back until the next
piece decides it, so nothing that ends up cut is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(pending: str, stops: Sequence[str]) -> str | None:
    """The stop string that ends `pending` where `scan_stops` cuts it (the earliest;
    at one place, the one listed first), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = pending.find(stop) if stop else -1
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best[1] if best is not None else None


def scan_stops(pending: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """Split `pending` into (emit now, hold back, stopped).

    On a match, everything before the earliest stop string is emitted and the
    rest is dropped.  Otherwise the longest suffix that is a proper prefix of
    some stop string is held back.
    """
    if not stops:
        return pending, "", False
    first = -1
    for stop in stops:
        if not stop:
            continue
        at = pending.find(stop)
        if at != -1 and (first == -1 or at < first):
            first = at
    if first != -1:
        return pending[:first], "", True
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(pending)), hold, -1):
            if pending.endswith(stop[:n]):
                hold = n
                break
    return pending[: len(pending) - hold], pending[len(pending) - hold :], False

"""Clocks, injected where timing decides (breakers, queue and first-token clocks,
liveness), so tests advance time instead of sleeping through it.

    Clock = Callable[[], float]          monotonic seconds; the default is time.monotonic
    ManualClock()                        a clock that moves only when told: advance(s)

Real waiting (a socket poll, an `asyncio.sleep`) still takes real time; what a
clock decides is whether a deadline has passed when the code looks.  Code that
waits on a deadline wakes at least every few tenths of a second to look again,
so a test that advances a ManualClock sees the deadline pass at the next look.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

monotonic: Clock = time.monotonic


class ManualClock:
    """A monotonic clock for tests: starts at `start`, moves by `advance` only."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now += seconds
        return self.now

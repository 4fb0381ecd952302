"""A seat's engine hands MLX's freed buffers back after a pause (`seatd.idle_trim`): the
decision as a table, and the engine's own thread on the packaged demo model, timed by an
injected clock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest

from seatd.batch import Engine
from seatd.engine_io import Transcript, Work
from seatd.idle_trim import AFTER_S, IdleTrim
from shared.protocol import Generate, SamplingParams
from tests.demo_engine import demo_engine

# (events: ("busy",) or ("idle", now), what each idle() answers)
TABLE = [
    ([("idle", 0.0), ("idle", 1.9), ("idle", 2.0), ("idle", 9.0)], [False, False, True, False]),
    # work restarts the pause: 1.5 s idle, work, then 1.5 s idle again is no pause of 2 s
    ([("idle", 0.0), ("idle", 1.5), ("busy",), ("idle", 3.0), ("idle", 4.5), ("idle", 5.0)],
     [False, False, False, False, True]),
    # one trim a pause, a new one after work
    ([("idle", 0.0), ("idle", 2.5), ("busy",), ("idle", 10.0), ("idle", 12.0)],
     [False, True, False, True]),
    # a pause that begins late begins at its first idle moment, not at zero
    ([("busy",), ("idle", 100.0), ("idle", 101.0), ("idle", 102.0)], [False, False, True]),
]


@pytest.mark.parametrize(("events", "answers"), TABLE)
def test_trim_once_a_pause(events: list[tuple[Any, ...]], answers: list[bool]) -> None:
    trim = IdleTrim(2.0)
    got = []
    for event in events:
        if event[0] == "busy":
            trim.busy()
        else:
            got.append(trim.idle(event[1]))
    assert got == answers


class Clock:
    """The engine's clock, set by the test; counts the engine's looks at it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.looks = 0
        self.looked = threading.Condition()

    def __call__(self) -> float:
        with self.looked:
            self.looks += 1
            self.looked.notify_all()
            return self.now

    def set_and_wait(self, now: float, looks: int = 3) -> None:
        """Set the time, then wait until the engine has looked at it `looks` times."""
        with self.looked:
            self.now, target = now, self.looks + looks
            assert self.looked.wait_for(lambda: self.looks >= target, timeout=60), \
                "the engine stopped looking at its clock"


@dataclass
class Engaged:
    eng: Engine
    clock: Clock
    trims: list[int]  # MLX's cache after each trim, as the callback saw it
    trimmed: threading.Event
    rang: threading.Event  # the outbox has events


@pytest.fixture
def engine() -> Iterator[Engaged]:
    rang = threading.Event()
    eng = demo_engine(rang.set)
    clock = Clock()
    trims: list[int] = []
    trimmed = threading.Event()

    def on_trim() -> None:
        trims.append(mx.get_cache_memory())
        trimmed.set()

    eng.clock, eng.on_trim = clock, on_trim
    thread = threading.Thread(target=eng.run, daemon=True)
    thread.start()
    yield Engaged(eng, clock, trims, trimmed, rang)
    eng.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()


def serve(e: Engaged, rid: str, told: Transcript) -> list[int]:
    """One seeded request through the running engine; its answer's tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=3)
    e.eng.submit(Work(Generate(rid, False, params, prompt="x"),
                      list(e.eng.tokenizer.encode("def fibonacci(n):")), "fp16"))
    while rid not in told.ended:
        assert e.rang.wait(60), "the engine said nothing"
        e.rang.clear()
        told.read(e.eng.outbox)
    result = told.result(rid)
    assert told.ended[rid].error is None and result is not None
    return result.token_ids


def test_engine_trims_after_a_pause_and_never_while_serving(
        engine: Engaged) -> None:
    """After a request the process holds freed buffers; the engine hands them back only
    once it has had nothing to do for AFTER_S by its clock, once a pause; a request after
    a trim is answered as the one before it."""
    clock, trims, trimmed = engine.clock, engine.trims, engine.trimmed
    told = Transcript()
    first = serve(engine, "a", told)
    assert mx.get_cache_memory() > 0  # something to hand back
    clock.set_and_wait(AFTER_S * 0.9)
    assert trims == []  # not yet a pause long enough
    clock.set_and_wait(AFTER_S * 1.1)
    assert trimmed.wait(60)
    assert trims == [0]
    clock.set_and_wait(AFTER_S * 50)
    assert len(trims) == 1  # once a pause
    trimmed.clear()
    # the clock stands still at 100 s: the pause starts there
    assert serve(engine, "b", told) == first
    clock.set_and_wait(AFTER_S * 50 + AFTER_S * 0.5)
    assert len(trims) == 1
    clock.set_and_wait(AFTER_S * 52)
    assert trimmed.wait(60) and len(trims) == 2

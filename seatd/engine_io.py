"""The one seam between a seat's worker and its batch engine: data in, events out.

    worker (asyncio thread)                     engine (the MLX thread)
    ----------------------                      -----------------------
    prepare the request (tokens, caps,
      grammar, KV reserve) -> Work   --submit-->  inbox
    work.cancel.set()                --flag---->  read between steps
                                                  admit: Admission.admit(work)
                                                    (prompt cache, speculation plan)
    read the outbox  <--------events-----------  Started, Text, Ended
      (one reader; the outbox rings it)

The worker hands the engine a request already prepared (`Work`: its prompt ids, KV lane,
reserved bytes, grammar matcher), and reads one ordered stream of what became of it
(`Started` as it is admitted, `Text` for each committed piece, `Ended` with its result
or the error that ended it).  Nothing on the MLX thread calls up into the worker: the
engine writes events into its `Outbox`, whose only word to the reader is a ring when the
outbox stops being empty (`Outbox(ring)`: the worker's is `loop.call_soon_threadsafe` of
a wake-up; a caller that drives the engine itself, the warm-up, a bench, a test, reads
it after each step with `Transcript`).

What a seat decides as a request is admitted (its cached prefix, whether it speculates,
and how far) runs on the MLX thread, because it restores MLX arrays and reads the
seat's running figures: an `Admission` the engine was built with, one of the seat's own
parts (`seatd.seating.SeatAdmission`), never the worker.  An engine built without one
takes each `Work`'s own speculation plan and no cached prefix.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from seatd.engine_types import DecodeResult, Resume, Speculation
from seatd.shaping import Matcher
from shared.protocol import Generate, TokenLogprob


class RowCancelled(Exception):
    """The request was cancelled (its `Work.cancel` was set) before it ended."""


@dataclass
class Work:
    """A request as the engine takes it: prepared (prompt ids, lane, bytes held), and
    from then on the engine's.  `spec` is the request's speculation plan where the engine
    has no `Admission` (the warm-up, a bench, tests); a seat's admission decides it."""

    request: Generate
    prompt: list[int]
    kv: str
    reserve: int = 0  # KV bytes held for this row (`seatd.kv_budget`)
    # Structured output: the answer's matcher, already past a continued answer's prefix
    # (`seatd.grammar.SeatGrammar.for_request`); the engine feeds it every token taken.
    grammar: Matcher | None = None
    fault: bool = False  # an injected prefill fault (the worker's SANCTUM_FAULT_ROW)
    device_fault: bool = False  # ... that the device stays lost after (SANCTUM_FAULT_DEVICE)
    spec: Speculation | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    # Set by the worker when the answer is complete by what it says (a tool call made a
    # second time): the row ends as if it had stopped, at the engine's next step.
    complete: threading.Event = field(default_factory=threading.Event)
    # The engine's own, from here on:
    arrived: int = 0  # `Engine.decoded` as it reached the engine (`Engine.submit`)
    resume: Resume | None = None  # where its cached prefix resumes (its admission's)
    finish: Callable[[bool], None] | None = None  # tells the prompt cache how it ended
    first_token_at: float | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class Admitted:
    """What a seat decided as the engine admitted a request."""

    resume: Resume | None = None
    spec: Speculation | None = None
    finish: Callable[[bool], None] | None = None  # the prompt cache's end of it


class Admission(Protocol):
    """A seat's decisions at admission, on the MLX thread; raising ends the request
    with that error before it starts."""

    def admit(self, work: Work) -> Admitted: ...


class Fixed:
    """No prompt cache, and each request's own speculation plan (`Work.spec`)."""

    def admit(self, work: Work) -> Admitted:
        return Admitted(spec=work.spec)


@dataclass(frozen=True)
class Started:
    rid: str
    at: float  # time.monotonic() as it was admitted


@dataclass(frozen=True)
class Text:
    """A committed piece of an answer: its text, the answer's tokens so far, the
    speculation state, the new token ids and their log-probabilities (when asked)."""

    rid: str
    text: str
    count: int
    state: str
    ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Ended:
    """The request left the engine: its result, or the error that ended it (then
    `result` is None).  `prompt_tokens`: the prompt it was given."""

    rid: str
    result: DecodeResult | None
    error: BaseException | None
    prompt_tokens: int
    first_token_at: float | None = None


Event = Started | Text | Ended


class Outbox:
    """The engine's events in order, for one reader on any thread.  `ring` is called
    (on the engine's thread) when an event lands in an empty outbox: the reader takes
    everything there is at once."""

    def __init__(self, ring: Callable[[], None] | None = None) -> None:
        self._events: deque[Event] = deque()
        self._lock = threading.Lock()
        self.ring = ring

    def put(self, event: Event) -> None:
        with self._lock:
            was_empty = not self._events
            self._events.append(event)
        if was_empty and self.ring is not None:
            self.ring()

    def take(self) -> list[Event]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out


@dataclass
class Transcript:
    """What a caller that drives the engine itself reads of each request: its pieces
    of text and how it ended."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    ids: dict[str, list[int]] = field(default_factory=dict)
    started: dict[str, Started] = field(default_factory=dict)
    ended: dict[str, Ended] = field(default_factory=dict)

    def read(self, outbox: Outbox) -> Sequence[Event]:
        events = outbox.take()
        for event in events:
            match event:
                case Started():
                    self.started[event.rid] = event
                case Text():
                    self.texts.setdefault(event.rid, []).append(event.text)
                    self.ids.setdefault(event.rid, []).extend(event.ids)
                case Ended():
                    self.ended[event.rid] = event
        return events

    def result(self, rid: str) -> DecodeResult | None:
        ended = self.ended.get(rid)
        return ended.result if ended is not None else None

    def error(self, rid: str) -> BaseException | None:
        ended = self.ended.get(rid)
        return ended.error if ended is not None else None

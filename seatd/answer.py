"""One request's answer as tokens arrive: end of sequence, stops, budget, committed text.

The decode loop of a single request and the batch engine both feed sampled tokens in
here one at a time, so what a client receives for a given token sequence never depends
on which of them produced it:

    answer = Answer(tokenizer, params, budget, emit)
    while not answer.done: answer.take(token)
    answer.close()          flush what the detokenizer and the stop scan held back

`emit(text, completion_tokens)` gets committed text only: a stop string is cut before
it is ever sent, so a client never sees text retracted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from seatd.stops import scan_stops
from shared.protocol import SamplingParams


class Answer:
    def __init__(self, tokenizer: Any, params: SamplingParams, budget: int,
                 emit: Callable[[str, int], None] | None = None) -> None:
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stops = params.stop
        self.budget = budget
        self.emit = emit
        self.pieces: list[str] = []
        self.ids: list[int] = []
        self.pending = ""
        self.finish = "length"
        self.done = budget <= 0
        self.cut = False
        self.closed = False

    @property
    def produced(self) -> int:
        return len(self.ids)

    def _send(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.emit is not None:
                self.emit(text, len(self.ids))

    def take(self, token: int) -> bool:
        """One sampled token; True when the answer is complete."""
        if self.done:
            return True
        if token in self.eos:
            self.finish, self.done = "stop", True
            return True
        self.ids.append(token)
        self.detok.add_token(token)
        self.pending += self.detok.last_segment
        now, self.pending, stopped = scan_stops(self.pending, self.stops)
        self._send(now)
        if stopped:
            self.finish, self.cut, self.done = "stop", True, True
        elif len(self.ids) >= self.budget:
            self.done = True
        return self.done

    def close(self) -> None:
        """The stream ended: flush what was held back (unless a stop string cut it)."""
        if self.closed:
            return
        self.closed = True
        if self.cut:
            return
        self.detok.finalize()
        self.pending += self.detok.last_segment
        now, held, stopped = scan_stops(self.pending, self.stops)
        if stopped:
            self.finish = "stop"
        self._send(now if stopped else now + held)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

"""One request's answer as tokens arrive: end of sequence, stops, budget, committed text.

The decode loop of a single request and the batch engine both feed sampled tokens in
here one at a time, so what a client receives for a given token sequence never depends
on which of them produced it:

    answer = Answer(tokenizer, params, budget, emit)
    while not answer.done: answer.take(token)
    answer.close()          flush what the detokenizer and the stop scan held back

`emit(text, completion_tokens)` gets committed text only: a stop string is cut before
it is ever sent, so a client never sees text retracted.

A continued answer (another seat began it and failed) starts from `prefix`, the answer
tokens already produced, and `sent`, the text its client already has: the detokenizer
is fed the prefix first, so the text at the seam is what one uninterrupted answer
would have had (a byte-level BPE detokenizer drops the leading space of an answer's
first text, and holds a lone space or an unfinished UTF-8 sequence until the next
token), and text the client already has is never sent again.  Counts passed to `emit`
and `produced` are this seat's own tokens; the budget holds for the whole answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from seatd.stops import first_stop, scan_stops
from shared.protocol import SamplingParams


class Answer:
    def __init__(self, tokenizer: Any, params: SamplingParams, budget: int,
                 emit: Callable[[str, int], None] | None = None,
                 prefix: Sequence[int] = (), sent: str = "") -> None:
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
        self.stop_sequence: str | None = None  # the stop string that ended it
        self.done = budget <= len(prefix)
        self.cut = False
        self.closed = False
        self.skip = 0  # characters still to come that the client already has
        self._fresh = 0  # ids[:_fresh] were handed out by `fresh_ids`
        for token in prefix:
            self.ids.append(token)
            self.detok.add_token(token)
        self.start = len(self.ids)
        self._fresh = self.start
        if prefix or sent:
            self.pending, self.skip = seam(self.detok.last_segment, sent)

    @property
    def produced(self) -> int:
        """Tokens this seat produced (a continued answer's prefix is not among them)."""
        return len(self.ids) - self.start

    def fresh_ids(self) -> tuple[int, ...]:
        """The answer tokens taken since the last call (their text may still be held)."""
        out = tuple(self.ids[self._fresh:])
        self._fresh = len(self.ids)
        return out

    def _send(self, text: str) -> None:
        if self.skip and text:
            cut = min(self.skip, len(text))
            text, self.skip = text[cut:], self.skip - cut
        if text:
            self.pieces.append(text)
            if self.emit is not None:
                self.emit(text, self.produced)

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
        before = self.pending
        now, self.pending, stopped = scan_stops(self.pending, self.stops)
        self._send(now)
        if stopped:
            self.finish, self.cut, self.done = "stop", True, True
            self.stop_sequence = first_stop(before, self.stops)
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
            self.stop_sequence = first_stop(self.pending, self.stops)
        self._send(now if stopped else now + held)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def seam(head: str, sent: str) -> tuple[str, int]:
    """Where a continued answer picks up: (text taken but not yet sent, characters of
    the text still to come that were already sent).  `head` is the detokenizer's text
    of the prefix tokens, `sent` what the client has.  The client may lack the end of
    `head` (held back for a stop string), or have more than `head` (a lone space or a
    multi-byte character the detokenizer still holds); a leading space the detokenizer
    drops is one the client has.  Raises ValueError when they do not agree at all."""
    if sent.startswith(" ") and not head.startswith(" "):
        sent = sent[1:]
    if head.startswith(sent):
        return head[len(sent):], 0
    if sent.startswith(head):
        return "", len(sent) - len(head)
    raise ValueError("the answer's text does not match its tokens")

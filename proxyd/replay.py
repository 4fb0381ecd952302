"""A begun answer continued by a rung that takes no assistant prefill: it is asked the
request afresh, and only what extends the text the client already has goes on.

A stream that broke after its commit is continued by the next rung from the text
already sent (`ladder.continued`: an assistant prefill).  Some upstreams refuse a
prefill (a 400 to a chat that ends with an assistant turn); such a rung
(`prefill = false`, or remembered after its first 400) is asked the original request
instead, and its answer replays the start the client has before it goes on:

    replay = Replay(sent)              the text the client has
    replay.take(chunk) -> Chunk        what of the chunk extends it (text, tokens and
                       | None          log-probabilities past the replayed start); None:
                       | DIVERGED      all of it replays what was sent; DIVERGED: the
                                       answer says something else than was sent

A rung whose answer diverges cannot finish this one without a contradicting word: its
try ends there and the ladder goes on (nothing of it reached the client).  A seeded
request, or a provider that answers a request alike twice, replays exactly.  Pure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from shared.protocol import Chunk


class Diverged(enum.Enum):
    DIVERGED = "diverged"


DIVERGED = Diverged.DIVERGED


@dataclass
class Replay:
    sent: str
    seen: str = ""  # the rung's text so far, while it still replays `sent`
    past: bool = False  # its text has gone beyond `sent`
    replayed_tokens: int = 0  # its tokens spent replaying (its count at the last held chunk)

    def take(self, chunk: Chunk) -> Chunk | Diverged | None:
        if self.past:
            return _less(chunk, self.replayed_tokens)
        start = len(self.seen)
        self.seen += chunk.text
        n = min(len(self.seen), len(self.sent))
        if self.seen[:n] != self.sent[:n]:
            return DIVERGED
        if len(self.seen) <= len(self.sent):
            self.replayed_tokens = chunk.completion_tokens
            return None
        self.past = True
        skip = len(self.sent) - start  # characters of this chunk that replay `sent`
        lps, used = [], 0
        for lp in chunk.logprobs:  # a token that straddles the seam is dropped with it
            if used >= skip:
                lps.append(lp)
            used += len(lp.token)
        # The chunk's own tokens that replayed `sent`: counted where its log-probabilities
        # say, else in proportion to its characters (a hosted rung counts its events).
        own = chunk.completion_tokens - self.replayed_tokens
        replayed = (len(chunk.logprobs) - len(lps) if chunk.logprobs
                    else round(own * skip / max(1, len(chunk.text))))
        self.replayed_tokens += max(0, min(own, replayed))
        return msgspec.structs.replace(
            chunk, text=self.seen[len(self.sent):], logprobs=tuple(lps),
            completion_tokens=max(0, chunk.completion_tokens - self.replayed_tokens))


def _less(chunk: Chunk, tokens: int) -> Chunk:
    return msgspec.structs.replace(chunk,
                                   completion_tokens=max(0, chunk.completion_tokens - tokens))

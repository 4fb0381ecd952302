"""Drafters: who proposes the tokens a speculative round verifies.

One interface, so block drafters and native multi-token heads can join later:

    start(prompt_ids)                                  see the prompt (prefill, index)
    propose(k, params, draws, position, shaper=None) -> Draft | None
                                  up to k tokens for answer positions position.., lazily
    settle(kept, drafted, next_token)                  the round's verdict: roll back to it

A model drafter draws with the request's own rule (`seatd.sampling`): for a seeded
request the same keyed noise as the target at each position, so a draft is kept
exactly when it is the token the target would have drawn there.  A row that shapes its
logits (`seatd.shaping`: penalties, bias, a grammar) passes its `Shaper`: a model
drafter shapes its own logits the same way, stepping a copy of the row's state through
its drafted tokens, so its proposal is the target's rule on the drafter's logits.  A
drafter says it can do that with `shapes = True`; the engine declines speculation for a
shaped row whose drafter cannot (`declined:constrained`).

`ModelDrafter` runs a small model sharing the target's tokenizer, with its own
cache kept in step with the target's.  `LookupDrafter` copies what followed the
best of the latest earlier occurrences of the context's last n-gram (prompt lookup): no
weights, strong on code edits and copies; its q is one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from seatd.sampling import Draws
from seatd.shaping import Shaper
from seatd.verify import draft_probs
from shared.protocol import SamplingParams

PREFILL_CHUNK = 512


@dataclass
class Draft:
    tokens: mx.array  # (k,) lazy
    probs: mx.array | None  # (k, V) lazy; None for a one-hot drafter
    k: int


class Drafter(Protocol):
    def start(self, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, k: int, params: SamplingParams, draws: Draws,
                position: int, shaper: Shaper | None = None) -> Draft | None: ...

    def settle(self, kept: int, drafted: int, next_token: int, tokens: Sequence[int]) -> None: ...

    def plain(self, token: int) -> None: ...


class ModelDrafter:
    """A small model drafting autoregressively; its cache follows the target's."""

    name = "model"
    shapes = True

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: list[Any] = []
        self.pending: list[int] = []
        self._prompt = mx.array([], dtype=mx.uint32)
        self._done = 0

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.begin(prompt_ids)
        while not self.advance(PREFILL_CHUNK):
            pass

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start on a prompt; `advance` prefills it a chunk at a time (a batch engine
        interleaves those chunks with other rows' steps)."""
        self.cache = mlx_cache.make_prompt_cache(self.model)
        self._prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
        self._done = 0
        self.pending = [int(prompt_ids[-1])]

    def advance(self, n: int) -> bool:
        """Prefill up to `n` more prompt tokens; True when the prompt is in."""
        upto = self._prompt.shape[0] - 1
        if self._done < upto:
            step = min(n, PREFILL_CHUNK - self._done % PREFILL_CHUNK, upto - self._done)
            self.model(self._prompt[None, self._done : self._done + step], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self._done += step
        return self._done >= upto

    @property
    def to_take(self) -> int:
        """Prompt tokens `advance` has still to take."""
        return max(0, int(self._prompt.shape[0]) - 1 - self._done)

    def propose(self, k: int, params: SamplingParams, draws: Draws,
                position: int, shaper: Shaper | None = None) -> Draft:
        x = mx.array(self.pending, dtype=mx.uint32)[None]
        logits = self.model(x, cache=self.cache)[:, -1, :]
        tokens: list[mx.array] = []
        rows: list[mx.array] = []
        # Rejection sampling (unseeded, above 0) needs the drafter's distribution q.
        with_q = params.temperature > 0 and not draws.keyed
        walk = shaper.cursor() if shaper is not None else None
        for i in range(k):
            if walk is not None:
                logits = walk.shape(logits)
            if with_q:
                rows.append(draft_probs(logits, params))
            t = draws.token(logits, params, position + i)
            tokens.append(t)
            if walk is not None and i < k - 1:
                walk.push(t)
            if i < k - 1:
                logits = self.model(t[None], cache=self.cache)[:, -1, :]
        probs = mx.concatenate(rows, axis=0) if rows else None
        return Draft(mx.concatenate(tokens), probs, k)

    def settle(self, kept: int, drafted: int, next_token: int, tokens: Sequence[int]) -> None:
        # The cache holds pending + drafts[:-1]; keep pending + drafts[:kept].
        if kept == drafted:
            self.pending = [int(tokens[-1]), next_token]
        else:
            mlx_cache.trim_prompt_cache(self.cache, drafted - 1 - kept)
            self.pending = [next_token]

    def plain(self, token: int) -> None:
        """A token the target made without a draft: fed with the next proposal."""
        self.pending.append(token)


MATCH_CAP = 32  # a match is measured back this far: past it, longer says no more
RECENT_STARTS = 8  # occurrences of the longest n-gram compared by how far they match


def match_key(matched: int) -> int:
    """The class of a lookup match by how many context tokens it matched: the n-gram
    lengths themselves, then 4-7, 8-15 and 16 or more.  A match that runs on for a line
    is a copy in progress and is judged apart from a stray trigram.  Pure."""
    for floor in (16, 8, 4):
        if matched >= floor:
            return floor
    return matched


MATCH_KEYS = (2, 3, 4, 8, 16)  # match_key of the matches a model seat's lookup drafts from


class LookupDrafter:
    """Prompt n-gram lookup: propose what followed the context's tail where it occurred
    before, choosing, among the latest few occurrences of the longest n-gram that
    occurred, the one whose earlier tokens match the context furthest back (ties: the
    latest).  `matched` is how far that is (at most MATCH_CAP); `key` its class
    (`match_key`), by which a seat keeps the lookup's figures apart: a copy in progress
    matches far back and keeps its drafts, a stray trigram seldom does.

    Its q is one-hot, so shaping needs nothing of it: the verifier judges its drafts
    against the shaped target, and cuts a draft at a token the grammar forbids.

    The context is indexed (each n-gram's latest starts with a token after them), so
    finding a match costs a dictionary lookup per n-gram length and a few short
    comparisons, not a scan of the context: a seat asks every round, and while parked
    every token.  Tokens are indexed when a match is next asked for (`find`), not as
    they come: a row stepping plainly in a batch that does not speculate (on CUDA, any
    batch) takes each of its tokens with one append, and a row that ends there never
    pays for the index (16 rows indexing their tokens took some 0.15 ms of host work
    a step on this project's 2-core CPU).  The index is the same either way: it is
    built over the same tokens in the same order."""

    name = "lookup"
    shapes = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.context: list[int] = []
        # the longest n-grams' latest starts (compared by how far back they match), and
        # each shorter n-gram's latest start (it cannot match further back than itself)
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # the context's first tokens whose n-grams are in the index
        self.matched = 0  # how many tokens `find`'s last match matched (0: none)
        self.key = 0  # match_key(matched)

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.context = []
        self._starts = {}
        self._latest = {}
        self._indexed = 0
        self.extend(prompt_ids)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens that follow the context (the target's, whoever drafted them)."""
        self.context.extend(int(t) for t in tokens)

    def _index(self) -> None:
        """The n-grams of the tokens taken since the last match into the index."""
        ctx = self.context
        starts, latest, top = self._starts, self._latest, self.max_ngram
        for end in range(self._indexed, len(ctx)):
            # n-grams ending just before token `end` now have a follower
            for n in range(self.min_ngram, top):
                if end - n >= 0:
                    latest[tuple(ctx[end - n : end])] = end - n
            if end - top >= 0:
                gram = tuple(ctx[end - top : end])
                at = starts.get(gram)
                if at is None:
                    starts[gram] = [end - top]
                else:
                    at.append(end - top)
                    if len(at) > RECENT_STARTS:
                        del at[0]
        self._indexed = len(ctx)

    def find(self, k: int) -> list[int]:
        """Up to k tokens that followed the best earlier occurrence of the longest
        n-gram ending the context (none: no n-gram of it occurred before)."""
        self._index()
        ctx = self.context
        last = len(ctx)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if last <= n:
                continue
            gram = tuple(ctx[-n:])
            if n < self.max_ngram:  # a shorter n-gram cannot match further back
                found = self._latest.get(gram)
                if found is None:
                    continue
                best, matched = found, n
            else:
                at = self._starts.get(gram)
                if not at:
                    continue
                best, matched = at[-1], n
                for start in reversed(at):  # latest first: a tie keeps the latest
                    m = n
                    while m < MATCH_CAP and start + n - m > 0 \
                            and ctx[start + n - m - 1] == ctx[last - m - 1]:
                        m += 1
                    if m > matched:
                        best, matched = start, m
                        if m >= MATCH_CAP:  # none can match further
                            break
            self.matched, self.key = matched, match_key(matched)
            return ctx[best + n : best + n + k]
        self.matched = self.key = 0
        return []

    def propose(self, k: int, params: SamplingParams, draws: Draws,
                position: int, shaper: Shaper | None = None) -> Draft | None:
        follow = self.find(k)
        if not follow:
            return None
        return Draft(mx.array(follow, dtype=mx.uint32), None, len(follow))

    def settle(self, kept: int, drafted: int, next_token: int, tokens: Sequence[int]) -> None:
        self.extend([*tokens[:kept], next_token])

    def plain(self, token: int) -> None:
        self.context.append(int(token))

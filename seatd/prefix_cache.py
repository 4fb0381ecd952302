"""The prompt cache's policy: which stored prefix a request resumes from, what is
kept, what is thrown away and why.  Pure: tokens and byte counts in, decisions
and counts out; the MLX cache objects it stores are opaque values here
(`seatd/prompt_cache.py` makes and restores them).

    lookup(tokens, limit)   the longest usable stored prefix, never past `limit`
    reserve(nbytes)         hold room for the request in flight; evict LRU to fit
    insert(tokens, ...)     keep a prefix; supersede, evict LRU, or refuse as too large
    invalidate(entry)       an error may have touched it: drop it

Rules:
- A usable length is a chunk boundary of both computations: a multiple of `align`
  (the decode loop's prefill grid), or a cut (a turn boundary, `seatd.turns`) of the
  request and of the entry (or the entry's own length), so a warm request computes
  the rest in exactly the chunks a cold one would.
- A trimmable entry (attention KV) serves any such prefix of itself; a
  non-trimmable one (recurrent or hybrid state) serves only its exact length.
  What trimming would have given beyond that is counted `not_trimmable`.
- Entries, plus the reservation of the request in flight, never exceed the budget;
  the least recently used entry goes first (`evicted`).  An entry larger than the
  whole budget is not inserted (`too_large`): it would evict everything else.
- A trimmable entry whose tokens another trimmable entry extends is superseded,
  not discarded, when the longer one also has a boundary at its length: the longer
  one still serves its tokens.

Discard reasons (counted in tokens): evicted, too_large, not_trimmable, invalidated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONS = ("evicted", "too_large", "not_trimmable", "invalidated")


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples."""
    n = min(len(a), len(b))
    i = 0
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)  # identity: two entries are never the same one
class Entry:
    namespace: str  # the KV lane: entries of one lane never serve another
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    value: Any = None
    used: int = 0  # LRU clock
    cuts: frozenset[int] = frozenset()  # its prefill's cuts off the grid, within it

    def boundary(self, n: int, align: int) -> bool:
        """Its prefill's chunks had a boundary after `n` tokens."""
        return n % align == 0 or n in self.cuts or n == len(self.tokens)


@dataclass(frozen=True)
class Hit:
    entry: Entry | None
    reuse: int  # tokens the request resumes from; 0 = cold
    not_trimmable: int = 0  # tokens the exact-length rule threw away


@dataclass
class Tally:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    discarded: dict[str, int] = field(default_factory=dict)

    def discard(self, reason: str, tokens: int) -> None:
        if tokens > 0:
            self.discarded[reason] = self.discarded.get(reason, 0) + tokens


class PrefixCache:
    def __init__(self, budget_bytes: int, align: int = 1) -> None:
        if align < 1:
            raise ValueError("align must be at least 1")
        self.budget = budget_bytes
        self.align = align
        self.entries: list[Entry] = []
        self.reserved = 0
        self.tally = Tally()
        self._clock = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _down(self, n: int) -> int:
        return n - n % self.align

    def _tick(self, entry: Entry) -> None:
        self._clock += 1
        entry.used = self._clock

    def _usable(self, e: Entry, common: int, cuts: tuple[int, ...]) -> int:
        """The longest prefix of `e`, at most `common` tokens, where both its prefill
        and the request's (cut at `cuts`, ascending) had a chunk boundary."""
        best = self._down(common)
        for c in reversed(cuts):
            if c <= best:
                break
            if c <= common and e.boundary(c, self.align):
                return c
        return best

    def lookup(self, namespace: str, tokens: tuple[int, ...], limit: int,
               cuts: tuple[int, ...] = ()) -> Hit:
        """The entry to resume from and how many tokens of it; `limit` is the most a
        request may resume from (its prompt less the token fed by the first step);
        `cuts`: the request's prefill cuts off the grid, ascending."""
        self.tally.lookups += 1
        best: Entry | None = None
        best_reuse = 0
        could = 0  # what the best entry would give if every entry were trimmable
        for e in self.entries:
            if e.namespace != namespace:
                continue
            common = min(common_prefix(e.tokens, tokens), limit, len(e.tokens))
            shared = self._usable(e, common, cuts)
            could = max(could, shared)
            if e.trimmable:
                reuse = shared
            else:  # exact length only, where the request's prefill cuts too
                n = len(e.tokens)
                reuse = n if common == n and (n % self.align == 0 or n in cuts) else 0
                could = max(could, reuse)
            if reuse > best_reuse or (reuse == best_reuse and reuse and best is not None
                                      and len(e.tokens) < len(best.tokens)):
                best, best_reuse = e, reuse
        lost = could - best_reuse
        self.tally.discard("not_trimmable", lost)
        if best is None or best_reuse == 0:
            return Hit(None, 0, lost)
        self._tick(best)
        self.tally.hits += 1
        self.tally.reused_tokens += best_reuse
        return Hit(best, best_reuse, lost)

    def _evict_to(self, room: int) -> None:
        """Evict least recently used entries until `room` more bytes fit."""
        while self.entries and self.nbytes + self.reserved + room > self.budget:
            victim = min(self.entries, key=lambda e: e.used)
            self.entries.remove(victim)
            self.tally.discard("evicted", len(victim.tokens))

    def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` for the request in flight (its live KV and the copy it may keep)."""
        self.reserved = max(0, nbytes)
        self._evict_to(0)

    def release(self) -> None:
        self.reserved = 0

    def insert(self, namespace: str, tokens: tuple[int, ...], nbytes: int, trimmable: bool,
               value: Any = None, cuts: tuple[int, ...] = ()) -> Entry | None:
        """Keep `tokens`' cache (its prefill cut at `cuts` off the grid); returns the
        entry that now serves them, or None."""
        if not tokens:
            return None
        if nbytes > self.budget:
            self.tally.discard("too_large", len(tokens))
            return None
        for e in self.entries:
            if e.namespace != namespace:
                continue
            if e.tokens == tokens or (e.trimmable and trimmable and len(e.tokens) > len(tokens)
                                      and e.tokens[: len(tokens)] == tokens
                                      and e.boundary(len(tokens), self.align)):
                self._tick(e)  # already served by an equal or longer entry
                return e
        entry = Entry(namespace, tokens, nbytes, trimmable, value,
                      cuts=frozenset(c for c in cuts if 0 < c < len(tokens)))
        if trimmable:
            self.entries = [e for e in self.entries
                            if not (e.namespace == namespace and e.trimmable
                                    and tokens[: len(e.tokens)] == e.tokens
                                    and entry.boundary(len(e.tokens), self.align))]
        self._evict_to(nbytes)
        if self.nbytes + self.reserved + nbytes > self.budget:
            # Only the reservation stands in the way: the request in flight comes first.
            self.tally.discard("evicted", len(tokens))
            return None
        self._tick(entry)
        self.entries.append(entry)
        return entry

    def invalidate(self, entry: Entry) -> None:
        """An error during a request that used `entry`: it may be wrong now; drop it."""
        if entry in self.entries:
            self.entries.remove(entry)
            self.tally.discard("invalidated", len(entry.tokens))

    def drain(self) -> Tally:
        """The counts since the last drain (the worker adds them to its counters)."""
        out, self.tally = self.tally, Tally()
        return out

"""A seat's speculation cost model, measured on the running machine.

A round of depth k by a model drafter costs

    round(k) = draft(k) + verify(k + 1) + host

draft(k): the drafter's k steps, its proposal evaluated; verify(w): the target's forward
over a block of w tokens and the acceptance decided on the device; host: the rest of the
round (reading the verdict, rolling caches back, settling the drafter, taking the tokens
into the answer).  A lookup round costs verify(k + 1) + host (its draft is a dictionary
lookup).  Plain decoding costs `plain` per token.

The batch engine measures the terms on some rounds of a request decoding alone: on those
it evaluates the proposal before the verify (one extra host sync), so the two can be timed
apart; every other round stays one graph with one sync.  The terms are moving averages
that one outlier (a first round of a new shape, compiling on a GPU) cannot carry
(`seatd.moving_average`).

    costs.due()                              whether this round is one to split
    costs.observe_round(k, drafted_s, verify_s, total_s, lookup)
    costs.observe_plain(seconds)
    costs.draft(k), costs.verify(w)          seconds, or None while unmeasured
    costs.round(k, lookup)                   a round's seconds, or None
    costs.snapshot() -> {term: microseconds}  for the seat's counters
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seatd.moving_average import moving

ALPHA = 0.2
SPLIT_EVERY = 8  # rounds of a request alone between two split (timed-apart) rounds


def _per_token(drafts: dict[int, float]) -> float | None:
    """Seconds per drafted token over drafting times by depth."""
    return sum(drafts.values()) / sum(drafts) if drafts else None


def _avg(into: dict[int, float], key: int, value: float, seen: dict[str, int],
         term: str) -> None:
    into[key] = moving(into.get(key), value, ALPHA, _count(seen, term))


def _count(seen: dict[str, int], term: str) -> int:
    """Observations of `term` before this one (and counts this one)."""
    n = seen.get(term, 0)
    seen[term] = n + 1
    return n


@dataclass
class SpecCosts:
    drafts: dict[int, float] = field(default_factory=dict)  # depth -> seconds
    verifies: dict[int, float] = field(default_factory=dict)  # width -> seconds
    host: float | None = None  # a model drafter's round, beyond drafting and verifying
    lookup_host: float | None = None  # a lookup round's, beyond verifying
    plain: float | None = None  # seconds per plain token, alone
    rounds: int = 0
    seen: dict[str, int] = field(default_factory=dict)  # observations by term

    def due(self) -> bool:
        """Whether the next round alone is split (counts every round asked about)."""
        self.rounds += 1
        return self.rounds % SPLIT_EVERY == 1

    def observe_round(self, depth: int, draft_s: float, verify_s: float, total_s: float,
                      lookup: bool = False) -> None:
        _avg(self.verifies, depth + 1, verify_s, self.seen, f"verify{depth + 1}")
        host = max(0.0, total_s - draft_s - verify_s)
        if lookup:
            host += draft_s  # the lookup's own work is host work
            self.lookup_host = moving(self.lookup_host, host, ALPHA,
                                      _count(self.seen, "lookup_host"))
        else:
            _avg(self.drafts, depth, draft_s, self.seen, f"draft{depth}")
            self.host = moving(self.host, host, ALPHA, _count(self.seen, "host"))

    def observe_plain(self, seconds: float) -> None:
        self.plain = moving(self.plain, seconds, ALPHA, _count(self.seen, "plain"))

    def draft(self, k: int) -> float | None:
        """Seconds to draft k tokens: measured, else per measured drafter step times k."""
        if k in self.drafts:
            return self.drafts[k]
        step = self.drafter_step()
        return step * k if step is not None else None

    def drafter_step(self) -> float | None:
        """Seconds per drafted token, over every measured depth."""
        return _per_token(self.drafts)

    def verify(self, width: int) -> float | None:
        if width in self.verifies:
            return self.verifies[width]
        known = sorted(self.verifies)
        if len(known) < 2:
            return None
        lo, hi = known[0], known[-1]  # a line through the narrowest and widest measured
        slope = max(0.0, (self.verifies[hi] - self.verifies[lo]) / (hi - lo))
        return self.verifies[lo] + slope * (width - lo)

    def round(self, k: int, lookup: bool = False) -> float | None:
        """Seconds of a round of depth k (k = 0: a plain token), or None while unknown."""
        if k == 0:
            return self.plain
        verify = self.verify(k + 1)
        if verify is None:
            return None
        if lookup:
            return verify + (self.lookup_host if self.lookup_host is not None
                             else self.host or 0.0)
        draft = self.draft(k)
        if draft is None or self.host is None:
            return None
        return draft + verify + self.host

    def snapshot(self) -> dict[str, int]:
        """The terms in microseconds: plain, drafter_step, draft_k, verify_wN, host,
        lookup_host (only those measured)."""
        out: dict[str, int] = {}  # read from another thread: copies of what may grow
        drafts, verifies = dict(self.drafts), dict(self.verifies)
        if self.plain is not None:
            out["plain"] = round(self.plain * 1e6)
        step = _per_token(drafts)
        if step is not None:
            out["drafter_step"] = round(step * 1e6)
        for k, s in sorted(drafts.items()):
            out[f"draft_{k}"] = round(s * 1e6)
        for w, s in sorted(verifies.items()):
            out[f"verify_w{w}"] = round(s * 1e6)
        if self.host is not None:
            out["host"] = round(self.host * 1e6)
        if self.lookup_host is not None:
            out["lookup_host"] = round(self.lookup_host * 1e6)
        return out

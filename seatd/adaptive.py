"""Adaptive draft length: pick the depth that maximises expected tokens per second.

Per seat, across requests: acceptance per draft position (how often position i
was kept, given the ones before it were) and the wall time of a round at each
depth, both as moving averages.  Expected tokens of a round of depth k are
1 + sum_{i<=k} prod_{j<=i} a_j; its rate is that over the round's time.  Depth 0
is plain decoding.

Two levels:
- `choose_depth` (per request, seat-wide figures): warms every depth up once, then
  parks a request at 0 when no depth beats plain decoding even at the seat's
  acceptance, re-probing now and then;
- `RoundPolicy` (per round, inside a request): the seat's round times as the request
  began, scaled by what the request's own rounds and plain tokens took once it has a
  few of each (`OwnTimes`, `own_times`), and the request's own acceptance (the seat's as a prior).
  Prose that the drafter predicts badly parks at 0 within a few rounds, in bursts of
  plain decoding with a probe round between them, each burst twice the last while the
  probes keep failing (`park_tokens`); code that it predicts well drafts deep; a
  request whose rounds cost more than the seat's figures said parks on its own times.
  Which depth a round drafts never changes a seeded request's tokens, only how many a
  verify keeps (`seatd.verify`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median

from seatd.moving_average import moving

MAX_DEPTH = 6
PRIOR_ACCEPT = 0.6  # a position's acceptance before any round was seen
PRIOR_WEIGHT = 2.0  # the seat's acceptance counts as this many rounds of the request's
PARK_TOKENS = 8  # plain tokens between probe rounds while parked at depth 0 (at first)
PARK_DOUBLINGS = 3  # a burst grows to at most PARK_TOKENS * 2**PARK_DOUBLINGS
# A parked request's failed probes cost at most this share of its time (and a losing batch
# size's, of the time between them: `seatd.batch_policy`): less than the 3%
# the default seat may trail its own plain path by (it must serve >= 0.97x), so that
# exploring alone cannot take it below; at 5%, a 128-token request on a GPU whose round
# costs 6 plain tokens more than a token ran a failed probe, up to 5% of its time.
PROBE_SHARE = 0.02
PARK_CAP = 1024  # ... in bursts of at most this many plain tokens
ALPHA = 0.1  # weight of a new observation
PROBE_EVERY = 8  # requests between probes of a neighbouring depth
WARM_ORDER = (3, 5, 1, 0, 2, 4, 6)  # each depth serves one request before rates decide
# A warm depth handed to a request goes to no other until the seat has seen this many
# rounds since (about one request's; rounds are seen only of a request alone) without
# one of that depth: its request ended before a round of it, or is not drafting it.
WARM_AGAIN = 32
SPIKE = 2.0  # a depth's figure this far above its neighbours' line is not believed
OWN_TIMES = 3  # a request's own rounds (or plain tokens) before their times scale its figures
OWN_WINDOW = 8  # ... its latest this many of each


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Tokens a round of depth k yields at these acceptances per position: 1 + the sum
    over i < k of the product of the first i + 1."""
    total, run = 1.0, 1.0
    for a in accept[:k]:
        run *= a
        total += run
    return total


@dataclass
class DepthStats:
    max_depth: int = MAX_DEPTH
    accept: list[float] = field(default_factory=list)  # empty: PRIOR_ACCEPT at each depth
    seconds: dict[int, float] = field(default_factory=dict)  # depth -> round time
    seen: dict[int, int] = field(default_factory=dict)
    timed: dict[int, int] = field(default_factory=dict)  # rounds in `seconds`, by depth
    handed: dict[int, int] = field(default_factory=dict)  # warm depth -> rounds then
    rounds: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self.accept = self.accept or [PRIOR_ACCEPT] * self.max_depth

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.accept, k)

    def rate(self, k: int) -> float | None:
        t = self.seconds.get(k)
        if t is None or t <= 0:
            return None
        return self.expected_tokens(k) / t


def choose_depth(s: DepthStats) -> int:
    """The draft depth of the next request (0 = plain decoding).

    A request keeps one depth from start to end, so that the same request at
    the same depth decodes the same way whether it streams or not.

    Each warm depth goes to one request at a time (`WARM_AGAIN`): requests that arrive
    together, before any of them has run a round, warm different depths, and those
    past the warm order take the best measured depth (the first warm depth while none
    is measured).  Measured on a 2-core CPU, 16 clients at once with the demo pair:
    handed the first unseen depth each, all 16 requests of a slot drafted at depth 6.
    """
    s.requests += 1
    for k in WARM_ORDER:
        if k <= s.max_depth and s.seen.get(k, 0) == 0 \
                and s.rounds - s.handed.get(k, -WARM_AGAIN) >= WARM_AGAIN:
            s.handed[k] = s.rounds
            return k
    if not any(s.rate(k) for k in range(s.max_depth + 1)):
        return min(WARM_ORDER[0], s.max_depth)
    best = max(range(s.max_depth + 1), key=lambda k: s.rate(k) or 0.0)
    if s.requests % PROBE_EVERY == 0:
        return min(s.max_depth, best + 1) if (s.requests // PROBE_EVERY) % 2 else max(0, best - 1)
    return best


def park_tokens(parks: int, seconds: Sequence[float] | None = None) -> int:
    """Plain tokens in a request's next parked burst, after `parks` bursts in a row whose
    probe round did not bring its policy back to drafting: PARK_TOKENS, doubled each
    time, up to PARK_DOUBLINGS times.  A probe round is exploration paid for at a failed
    round's cost; a request whose own rounds keep saying no explores less often, and one
    that drafts again starts over.

    `seconds` (a round's time at each depth, 0: a plain token, as `RoundPolicy` holds
    them): the burst is also long enough that a failed probe, the cheapest round less the
    plain token it still yields, costs at most PROBE_SHARE of the burst's time (at most
    PARK_CAP tokens).  Where a round costs many plain tokens (on a GPU whose host work per
    round outweighs a 1 ms forward) a parked request then probes seldom, by the measured
    times, not by a count tuned on one device.  Pure."""
    tokens = PARK_TOKENS << min(max(parks, 0), PARK_DOUBLINGS)
    if seconds is None or len(seconds) < 2 or seconds[0] <= 0:
        return tokens
    excess = min(seconds[1:]) - seconds[0]
    if excess <= 0:
        return tokens
    return max(tokens, min(PARK_CAP, math.ceil(excess / (seconds[0] * PROBE_SHARE))))


def observe(s: DepthStats, depth: int, kept: int, seconds: float | None) -> None:
    """Record a round: depth drafted, drafts kept, wall time (depth 0: time per plain token;
    None: a round whose time says nothing about a request alone, e.g. in a batch)."""
    s.rounds += 1
    s.seen[depth] = s.seen.get(depth, 0) + 1
    if seconds is not None:
        timed = s.timed.get(depth, 0)
        s.timed[depth] = timed + 1
        s.seconds[depth] = moving(s.seconds.get(depth), seconds, ALPHA, timed)
    # Positions up to the first rejection were tried; the rejected one counts as a miss.
    for i in range(min(kept + 1, depth)):
        hit = 1.0 if i < kept else 0.0
        s.accept[i] = (1 - ALPHA) * s.accept[i] + ALPHA * hit


def seed_times(s: DepthStats, seconds: dict[int, float]) -> None:
    """A round's seconds at some depths (0: a plain token), measured on this device
    before the seat served (`seatd.warm_shapes`), as the figures of the depths it has not
    timed yet; each counts as one observation, so the seat's own rounds take over within
    a few.  Acceptance is left as it is."""
    for k, t in seconds.items():
        if 0 <= k <= s.max_depth and t > 0 and not s.timed.get(k):
            s.seconds[k] = t
            s.timed[k] = 1


def round_times(s: DepthStats) -> tuple[float, ...] | None:
    """Seconds of a round at each depth 0..max (0: one plain token), or None while the seat
    lacks plain time or two positive depths.  A round costs about a + b*k: unmeasured
    depths are filled by a line through the measured ones, and a measured depth whose
    figure lies more than SPIKE times above that line takes the line's figure instead.

    The lines are Theil-Sen's (the median of the slopes between measured depths, through
    the median intercept), so that one or two depths whose rounds met something else
    cannot tilt them.  On a GPU a round now and then takes ten times its width's time (a
    kernel or a CUDA graph built for a shape met for the first time; measured on an
    H200: 42-86 ms rounds among 3-10 ms ones of the same depths), and an average keeps
    such a figure for many rounds; a depth that looks that dear is then never chosen
    again, so its figure never mends.  Taking the line there lets the depth be chosen
    on the merits of its neighbours, and its next rounds measure it again."""
    measured = {k: t for k, t in s.seconds.items() if t > 0 and k <= s.max_depth}
    pos = sorted(k for k in measured if k > 0)
    if 0 not in measured or len(pos) < 2:
        return None
    # Spikes are found against a line through the plain token's figure too (many
    # observations; with two depths measured, one of them a spike, it says which); the
    # depths left then draw the line, where two or more are.
    robust = _line(measured, [0, *pos])
    kept = [k for k in pos if measured[k] <= SPIKE * robust(k)]
    line = _line(measured, kept) if len(kept) >= 2 else robust
    return (measured[0], *(measured[k] if k in kept else line(k)
                           for k in range(1, s.max_depth + 1)))


def _deepest_before(tries: Sequence[int], i: int) -> int:
    """The deepest position before i that a request reached (-1: none)."""
    return next((j for j in range(i - 1, -1, -1) if tries[j]), -1)


def _borrows(tries: Sequence[int], i: int, deepest: int) -> bool:
    """`RoundPolicy.borrows`, given the deepest position before i that was reached."""
    return i > 0 and not tries[i] and 0 <= deepest and i <= 2 * deepest + 1


def _line(measured: dict[int, float], points: Sequence[int]) -> Callable[[int], float]:
    """Theil-Sen's line through these depths' figures: the median of the slopes between
    them (at least 0), through the median intercept."""
    slope = max(0.0, median([(measured[j] - measured[i]) / (j - i)
                             for n, i in enumerate(points) for j in points[n + 1:]]))
    base = median([measured[k] - slope * k for k in points])
    return lambda k: max(1e-9, base + slope * k)


PLAIN, MODEL, LOOKUP = "plain", "model", "lookup"  # whose times a request observes


def own_scale(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """What a drafter's round times are scaled by in a request: the median of its own
    rounds' times over their figures (`mine`, its latest), once it has OWN_TIMES of them;
    until then the other drafter's (`theirs`) where that says rounds cost less than the
    figures (so this one is tried, and measured), never more (another drafter's dear
    rounds, a model drafter's host work, say nothing of a lookup's: borrowed, they could
    keep it from ever being tried); 1 where neither has run enough.  The median: one
    round that built a new shape (on CUDA, 45-110 ms among 2-15 ms ones) does not move
    it.  Pure."""
    if len(mine) >= OWN_TIMES:
        return median(mine)
    if len(theirs) >= OWN_TIMES:
        return min(1.0, median(theirs))
    return 1.0


def own_times(base: Sequence[float], rounds: float, plain: float) -> tuple[float, ...]:
    """A request's round times at each depth (0: a plain token): the seat's figures as it
    began (`base`), its rounds' scaled by `rounds` and its plain token's by `plain`
    (`own_scale` of each).  One scale for every depth: a request learns what its rounds
    cost here from the few it ran, not depth by depth (the seat's figures say how a
    round's cost grows with its depth; what they miss is most often the same for all,
    e.g. host work per round on a device whose forward is short).

    Measured through the batching bench on an H100 (demo pair, one client): the default
    seat's requests drafted 28 rounds each of 11-19 ms against a plain token's 1.7 ms,
    at 0.41x its plain path's tokens/s, because their policies held the seat's figures
    from before they began.  Pure."""
    return (base[0] * plain, *(t * rounds for t in base[1:]))


@dataclass
class OwnTimes:
    """A request's own times over its figures, by whose they were (PLAIN, MODEL,
    LOOKUP): the latest OWN_WINDOW of each.  One per request, shared by its policies
    (its model drafter's, its lookup's by class: `seatd.speculation`), so each round is
    taken once; `seen` counts them, for the policies to know when to follow."""

    ratios: dict[str, list[float]] = field(default_factory=dict)
    seen: int = 0

    def observe(self, whose: str, ratio: float) -> None:
        """One of the request's rounds (a drafter's: MODEL, LOOKUP), or a plain token
        (PLAIN, timed as its forward), took `ratio` times its figure
        (`RoundPolicy.ratio`)."""
        ratios = self.ratios.setdefault(whose, [])
        ratios.append(ratio)
        del ratios[:-OWN_WINDOW]
        self.seen += 1

    def scales(self, drafter: str) -> tuple[float, float]:
        """(rounds, plain): what a `drafter`'s round times and a plain token's are scaled
        by (`own_scale`)."""
        other = LOOKUP if drafter == MODEL else MODEL
        return (own_scale(self.ratios.get(drafter, ()), self.ratios.get(other, ())),
                own_scale(self.ratios.get(PLAIN, ()), ()))


@dataclass
class RoundPolicy:
    """The draft depth of each round of one request (0: a burst of plain tokens).
    `base`: a round's time at each depth by the seat's figures as the request began;
    `seconds`: as the request now holds it, scaled by its own (`own`, `own_times`)."""

    base: tuple[float, ...]
    prior: tuple[float, ...]
    tries: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    drafter: str = MODEL  # whose rounds these are: MODEL, or LOOKUP (`seatd.drafter_choice`)
    own: OwnTimes = field(default_factory=OwnTimes, compare=False)
    # `expected_upto`'s figures since the last `observe`, by depth: a batch asks every
    # row's policy each step, and between two of its rounds the answer is the same
    _expected: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False,
                                              compare=False)
    # `seconds` as of `own.seen` observations
    _seconds: tuple[int, tuple[float, ...]] = field(default=(0, ()), init=False,
                                                    repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.base) - 1
        self.tries = self.tries or [0] * n
        self.hits = self.hits or [0] * n

    @property
    def seconds(self) -> tuple[float, ...]:
        """A round's time at each depth (0: a plain token) as the request now holds it."""
        seen, times = self._seconds
        if not times or seen != self.own.seen:
            times = own_times(self.base, *self.own.scales(self.drafter))
            self._seconds = (self.own.seen, times)
        return times

    @classmethod
    def from_stats(cls, s: DepthStats) -> RoundPolicy | None:
        times = round_times(s)
        if times is None:
            return None
        return cls(times, tuple(s.accept[: len(times) - 1]))

    @property
    def max_depth(self) -> int:
        return len(self.base) - 1

    def borrows(self, i: int) -> bool:
        """Whether position i, which the request never reached, borrows the estimate of
        the nearest one before it (see `accept`): only up to twice as deep as the deepest
        position it reached, so a request that keeps everything goes deeper by doubling
        (depth 3, 6, 12, 15), each round on what the last one showed, not at once to the
        deepest.  Further out a position takes the seat's prior.  On a GPU each verified
        row costs about a third of a plain step (an H200 with the demo pair: a depth-15
        lookup round 15 ms against 4.4 ms at depth 3 and 2.2 ms for a plain token), so a
        round drafted deep on borrowed hope that misses early costs several plain tokens;
        in-process on that device, a lookup seat on copy-heavy chats went from 1.54x to
        1.82x over plain at T=0 with this bound."""
        return _borrows(self.tries, i, _deepest_before(self.tries, i))

    def accept(self, i: int) -> float:
        """Acceptance of position i given the earlier ones kept: the request's own count
        over the seat's prior; a position the request never reached borrows the estimate
        of the nearest one before it where it `borrows`, so a request that keeps
        everything goes deeper."""
        if self.borrows(i):
            return self.accept(i - 1)
        return (self.prior[i] * PRIOR_WEIGHT + self.hits[i]) / (PRIOR_WEIGHT + self.tries[i])

    def expected(self, k: int) -> float:
        return self.expected_upto(k)[k]

    def expected_upto(self, top: int) -> list[float]:
        """Expected tokens of a round at each depth 0..top, in one pass over the
        positions (each depth's figure is the one before it plus one more product)."""
        known = self._expected.get(top)
        if known is not None:
            return list(known)
        out = [1.0]
        run, last, deepest = 1.0, 0.0, -1
        for i in range(top):
            # a borrowing position takes the figure of the one before it: carry it
            a = last if _borrows(self.tries, i, deepest) else self.accept(i)
            if self.tries[i]:
                deepest = i
            last = a
            run *= a
            out.append(out[-1] + run)
        self._expected[top] = out
        return list(out)

    def best(self, lowest: int = 0, highest: int | None = None) -> int:
        """The depth with the highest expected rate within [lowest, highest] (the
        shallower on a tie)."""
        top = self.max_depth if highest is None else min(highest, self.max_depth)
        expected, seconds = self.expected_upto(top), self.seconds
        return max(range(lowest, top + 1), key=lambda k: (expected[k] / seconds[k], -k))

    def ratio(self, depth: int, seconds: float) -> float | None:
        """A round of `depth` (0: a plain token) that took `seconds`, over the seat's
        figure of it as the request began (what `OwnTimes.observe` takes); None where
        there is no such figure."""
        if not 0 <= depth < len(self.base) or self.base[depth] <= 0 or seconds <= 0:
            return None
        return seconds / self.base[depth]

    def observe(self, drafted: int, kept: int) -> None:
        self._expected.clear()
        for i in range(min(kept + 1, drafted)):
            self.tries[i] += 1
            self.hits[i] += i < kept

"""Adaptive draft length: pick the depth that maximises expected tokens per second.

Per seat, across requests: acceptance per draft position (how often position i
was kept, given the ones before it were) and the wall time of a round at each
depth, both as moving averages.  Expected tokens of a round of depth k are
1 + sum_{i<=k} prod_{j<=i} a_j; its rate is that over the round's time.  Depth 0
is plain decoding, parked on when no depth beats it; depths are re-probed now
and then, since acceptance depends on the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DEPTH = 6
ALPHA = 0.1  # weight of a new observation
PROBE_EVERY = 8  # requests between probes of a neighbouring depth
WARM_ORDER = (3, 5, 1, 0, 2, 4, 6)  # each depth serves one request before rates decide


@dataclass
class DepthStats:
    max_depth: int = MAX_DEPTH
    accept: list[float] = field(default_factory=lambda: [0.6] * MAX_DEPTH)
    seconds: dict[int, float] = field(default_factory=dict)  # depth -> round time
    seen: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    requests: int = 0

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.accept[i]
            total += run
        return total

    def rate(self, k: int) -> float | None:
        t = self.seconds.get(k)
        if t is None or t <= 0:
            return None
        return self.expected_tokens(k) / t


def choose_depth(s: DepthStats) -> int:
    """The draft depth of the next request (0 = plain decoding).

    A request keeps one depth from start to end, so that the same request at
    the same depth decodes the same way whether it streams or not.
    """
    s.requests += 1
    for k in WARM_ORDER:
        if k <= s.max_depth and s.seen.get(k, 0) == 0:
            return k
    best = max(range(s.max_depth + 1), key=lambda k: s.rate(k) or 0.0)
    if s.requests % PROBE_EVERY == 0:
        return min(s.max_depth, best + 1) if (s.requests // PROBE_EVERY) % 2 else max(0, best - 1)
    return best


def observe(s: DepthStats, depth: int, kept: int, seconds: float) -> None:
    """Record a round: depth drafted, drafts kept, wall time (depth 0: time per plain token)."""
    s.rounds += 1
    s.seen[depth] = s.seen.get(depth, 0) + 1
    old = s.seconds.get(depth)
    s.seconds[depth] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds
    # Positions up to the first rejection were tried; the rejected one counts as a miss.
    for i in range(min(kept + 1, depth)):
        hit = 1.0 if i < kept else 0.0
        s.accept[i] = (1 - ALPHA) * s.accept[i] + ALPHA * hit

"""Which drafter drafts a row's next round, and how deep: a pure choice.

A seat whose drafter is a model also gives each adaptive row a lookup drafter
(`seatd.drafters.LookupDrafter`: what followed an earlier occurrence of the context's
last n-gram, the one matching furthest back; no weights, so a lookup round costs its
verify and no drafting).  Each drafter has its own per-round policy
(`seatd.adaptive.RoundPolicy`): its own acceptance per position, learnt by the request
over the seat's prior, and its own round times (the lookup's by the class of its match,
`seatd.drafters.match_key`).  Each round:

    model option   the model policy's best depth and its expected rate (depth 0: plain)
    lookup option  only when the context's tail occurred before: the lookup policy's
                   best depth among those it can fill (at most `match` tokens)
    the higher expected rate wins; on a tie, the model (its rate was measured whole)

    choose(model, model_cap, lookup, match) -> Choice(source, depth, expected)

The choice reads the row's counts and the seat's figures, never a clock or a seed: a
seeded row's tokens never depend on it (a draft decides how many tokens a verify keeps,
never which; `seatd.verify`).

Round times of the lookup drafter (`lookup_times`): measured where its rounds ran, a
line through them where two depths ran, else the model drafter's round time at that
depth less its drafting as the cost model measured it (`seatd.spec_costs`: verify plus
host), else the model drafter's whole round, an upper bound.  A round's time depends on
its width, not on how far back its match reached: the times come from the seat's lookup
rounds of every class together (`lookup_policy`'s `rounds`), the acceptance from the
class's own.  Kept per class, 16 depths' times over five classes were too few rounds
each: in a traced run on an H200 a class's figures were two to five times a round's real
time (a depth-3 round priced at 10.5 ms, compiling rounds of new shapes among a handful
of others), and the seat stepped plainly through copies that a pinned depth 3 drafted.

A lookup may draft deeper than the model drafter (`LOOKUP_MAX_DEPTH`): its round costs
only the verify, and where the answer copies its context a match runs on for many
tokens.  How deep it goes is the same choice, by its acceptance per position and its
round times, so a lookup that misses stays shallow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from seatd.adaptive import LOOKUP, DepthStats, OwnTimes, RoundPolicy, round_times

LOOKUP_MAX_DEPTH = 15  # a lookup round verifies at most 16 tokens
# Tokens of a passed-over match of a class the request does not trust yet that, held,
# judge it (`trusts`): a copy drafts from the next step, not after the whole match.
JUDGE_TOKENS = 2


@dataclass(frozen=True)
class Choice:
    source: str  # "model" | "lookup"; depth 0 is a plain token, whoever asked
    depth: int
    expected: float  # tokens the round is expected to yield


def _best(policy: RoundPolicy, lowest: int, highest: int) -> tuple[int, float]:
    """(depth, rate) of the policy's best depth within [lowest, highest]."""
    highest = min(highest, len(policy.seconds) - 1)
    if highest < lowest:
        return 0, 0.0
    k = policy.best(lowest, highest)
    return k, policy.expected(k) / policy.seconds[k]


def choose(model: RoundPolicy | None, model_cap: int, lookup: RoundPolicy | None,
           match: int, *, model_lowest: int = 0) -> Choice:
    """The next round of a row.  `model`: the model drafter's policy (None: it cannot
    draft this round, e.g. its prompt is still going in; plain decoding stays an option
    at the lookup's plain time); `model_cap`: its deepest depth now; `lookup`: the
    lookup drafter's policy (None: the row has none); `match`: how many tokens the
    lookup could propose now; `model_lowest` 1: a probe round of the model drafter."""
    if model is not None:
        depth, rate = _best(model, model_lowest, model_cap)
        choice = Choice("model", depth, model.expected(depth))
    else:
        plain = lookup.seconds[0] if lookup is not None else 1.0
        depth, rate, choice = 0, 1.0 / plain, Choice("model", 0, 1.0)
    if lookup is not None and match > 0:
        k, lookup_rate = _best(lookup, 1, match)
        if k > 0 and lookup_rate > rate:
            return Choice("lookup", k, lookup.expected(k))
    return choice


def trusts(key: int, policies: Mapping[int, RoundPolicy], seat_trusted: AbstractSet[int]) -> bool:
    """Whether a request drafts from its first match of class `key` (`match_key`: how
    far back the match goes) at its policy's prior, or judges one match of it first (as
    the answer goes past it): the former where the seat had settled figures of this
    class or of a shorter one when the request began (`seat_trusted`), or where the
    request itself has judged or drafted a match of such a class.  A longer match is
    trusted wherever a shorter one is: a copy in progress goes through the classes as it
    grows (3, 4, 8, 16), and is not judged again at each.  Trust only opens the choice;
    the class's own figures still decide whether and how deep a round drafts.  Pure."""
    return any(k <= key for k in seat_trusted) or any(
        k <= key and p.tries and p.tries[0] > 0 for k, p in policies.items())


def extend_times(times: tuple[float, ...], top: int) -> tuple[float, ...]:
    """Round times at depths 0..top: past the deepest given, a line through its last two
    depths (a round's cost grows with its width; a lookup may draft deeper than the model
    drafter, whose rounds these are).  Pure."""
    if len(times) > top or len(times) < 2:
        return times[: top + 1]
    slope = max(0.0, times[-1] - times[-2]) if len(times) > 2 else 0.0
    last = len(times) - 1
    return (*times, *(times[-1] + slope * (k - last) for k in range(last + 1, top + 1)))


def lookup_times(model_times: tuple[float, ...], stats: DepthStats,
                 estimate: Sequence[float | None] = ()) -> tuple[float, ...]:
    """Seconds of a lookup round at each depth 0..stats.max_depth (0: one plain token,
    the model's figure): see the module's docstring.  `estimate`: the cost model's lookup
    round by depth (`seatd.spec_costs`), used before the seat's own lookup rounds have a
    line of their own.  Past the model drafter's deepest depth its round time goes on
    as a line (`extend_times`)."""
    top = stats.max_depth
    model_times = extend_times(model_times, top)
    measured = {k: t for k, t in stats.seconds.items() if 0 < k <= top and t > 0}
    fitted = round_times(replace(stats, max_depth=top,
                                 seconds={**measured, 0: model_times[0]}))
    if fitted is not None:
        return fitted

    def guess(k: int) -> float:
        known = estimate[k] if k < len(estimate) else None
        return min(model_times[k], known) if known is not None and known > 0 else model_times[k]

    return tuple(measured.get(k, guess(k)) if k else model_times[0] for k in range(top + 1))


def lookup_policy(model_times: tuple[float, ...], stats: DepthStats,
                  estimate: Sequence[float | None] = (),
                  rounds: DepthStats | None = None, own: OwnTimes | None = None) -> RoundPolicy:
    """A request's lookup policy for one match class: the seat's figures of the class
    (`stats`) as its prior acceptance; round times from `rounds`, the seat's lookup
    rounds of every class (None: the class's own), scaled by the request's own times
    (`own`: the store its model drafter's policy holds; None: one of its own).  Pure."""
    times = lookup_times(model_times, rounds if rounds is not None else stats, estimate)
    return RoundPolicy(times, tuple(stats.accept[: len(times) - 1]), drafter=LOOKUP,
                       own=own if own is not None else OwnTimes())

"""Whether a batch step speculates: a verify step must beat a plain one at this size.

Pure, with the seat's measured step times passed in (`StepCosts`, moving averages
by batch size and tokens per row, drafting included in a verify step's time):

    plan_step(wants, batch, costs, joining, compiles) -> depth per row (all 0: plain)
    decide_step(wants, batch, costs, joining, compiles) -> StepPlan   the depths, and the
                                   rows whose wish to draft the step passed over, and why
    speculates(batch, compiles)    whether a step of that many rows may verify at all
    drafter_due(costs, batch, expected, deepest, left, prefill_s, compiles)   whether a
                                   row's model drafter takes its prompt now
    catch_up_due(seconds, expected, deepest, left, prefill_s)   whether a row left alone
                                   catches its drafter up
    paced(arrived, began)          whether a joining group keeps to the decoding rows' pace
    ride_tokens(ride, own, limit, n, first)   a joining prompt's tokens riding a step

`wants[b]` is (depth, expected tokens) of row b's next round as its own request's
policy sees it (`seatd.adaptive`): depth 0 means the row would decode plainly anyway.
A row alone follows its wish, as a request alone always has.  In a batch, a verify
step costs `t(B, n)` for n = 1 + the deepest draft and yields the rows' expected
tokens; a plain step costs `t(B, 1)` and yields B.  Speculation goes ahead only when

    sum(expected) / t(B, n)  >  B / t(B, 1)

On a backend that builds each new shape on first use (CUDA), a batch does not
speculate at all (`speculates`): its verify shapes cannot be built ahead, and a try's
time is the build's.

While a prompt joins the batch at its rows' pace (`joining`: its chunks ride their
steps or take a share of their time), the batch's steps are plain.  A step that
carries a prompt is not the rows' own, so its time is never measured: speculation
would be judged on times from before the prompt came, and rides sized against a
verify time from then (measured, 7 rows and a 1,500-token prompt: rides grew to 44
tokens and their steps to 160-200 ms, where the rows' own verify step took 90 ms and
their plain one 44 before the prompt came).  And the prompt's
share is a share of the rows' step: verify steps (2x a plain one at 7 rows here)
stretch every row's gap while someone waits for a first token.  Declined with its
own reason (`prompt_joining`); the probes come due as ever once it has joined.

The plain time a verify step is judged against is believed once SETTLED plain steps of
the size have been timed, each after a plain step of the same rows (the engine times
only those: a plain step's time is its forerunner's forward, and the first plain step
after a verify, a prefill or a change of rows waited on something else).  Measured on
this project's 2-core CPU, 16 clients with the demo pair: the first plain step at 12
rows, right after a verify step at 8 rows and four rows joining, took 157 ms against
about 40 ms for the plain steps after it; judged against that one figure, verify steps
of 7 tokens a row at 16 rows (238 ms each) won every step of the slot, and the default
seat served 0.80x of the plain seat's tokens/s there.

An unmeasured verify size is tried (it cannot be judged otherwise), and a size that
lost is tried again every `PROBE_EVERY` plain steps, since acceptance moves with the
rows in the batch; or less often where a probe costs more than PROBE_SHARE of the plain
steps between (`probe_every`: measured on the 2-core CPU, a verify step of 6 tokens a
row at 16 rows took 426 ms against 45 ms for a plain one, and a probe every 64 plain
steps cost about a tenth of the batch's time).  The other way round too: a size where
speculation wins takes a plain step every `PROBE_EVERY` verify steps, so that the plain
time it is judged against stays current (a first plain step of a class, slow for
reasons of its own, once kept a batch of 8 on 137 ms where its plain steps took 80).
A time measured after `PROBE_EVERY` steps of the other kind starts the figure afresh
instead of moving its average: so long after, the old one says little (a plain one is
then settled again before it judges).  The choice reads measured times, never a seed:
which tokens a seeded row gets never depends on it
(`seatd.sampling`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# PROBE_SHARE: a losing size's probes cost at most this share of the time between them,
# the same bound as a parked request's (`seatd.adaptive`)
from seatd.adaptive import PROBE_SHARE
from seatd.moving_average import moving

ALPHA = 0.2  # weight of a new step time
PROBE_EVERY = 64  # plain steps at one batch size between probes of a verify step
SETTLED = 2  # timed plain steps of a size before a verify step is judged against them
PROBE_CAP = 1024  # ... with at most this many plain steps between two
JOINING, NOT_PROFITABLE = "prompt_joining", "batch_not_profitable"  # why a step is plain


def size_class(batch: int) -> int:
    """Batch sizes share measurements in classes: 1, 2, 3-4, 5-8, 9-16, ..."""
    c = 1
    while c < batch:
        c *= 2
    return c


@dataclass
class StepCosts:
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    timed: dict[tuple[int, int], int] = field(default_factory=dict)  # observations in `seconds`
    plain_since_probe: dict[int, int] = field(default_factory=dict)  # since a verify step
    verify_since_plain: dict[int, int] = field(default_factory=dict)  # since a plain step

    def observe(self, batch: int, width: int, seconds: float | None) -> None:
        """A step of `batch` rows and `width` tokens each took `seconds`; None: it is
        counted (probes are due by steps taken) but its time was not the rows' own."""
        c = size_class(batch)
        key = (c, width)
        plain = width == 1
        if (self.verify_since_plain if plain else self.plain_since_probe).get(c, 0) \
                >= PROBE_EVERY:
            self.timed[key] = 0  # stale: the next timed step starts the figure afresh
        if seconds is not None:
            n = self.timed.get(key, 0)
            self.seconds[key] = moving(self.seconds.get(key) if n else None, seconds, ALPHA, n)
            self.timed[key] = n + 1
        if plain:
            self.plain_since_probe[c] = self.plain_since_probe.get(c, 0) + 1
            self.verify_since_plain[c] = 0
        else:
            self.plain_since_probe[c] = 0
            self.verify_since_plain[c] = self.verify_since_plain.get(c, 0) + 1

    def time(self, batch: int, width: int) -> float | None:
        return self.seconds.get((size_class(batch), width))

    def settled(self, batch: int) -> bool:
        """Whether the plain time at this size has been timed SETTLED times since it was
        last started afresh."""
        return self.timed.get((size_class(batch), 1), 0) >= SETTLED


def probe_every(plain: float, verify: float) -> int:
    """Plain steps between two probes of a verify size that lost: PROBE_EVERY, or as
    many as make the probe's cost beyond a plain step at most PROBE_SHARE of theirs
    (at most PROBE_CAP).  Pure."""
    excess = verify - plain
    if plain <= 0 or excess <= 0:
        return PROBE_EVERY
    return max(PROBE_EVERY, min(PROBE_CAP, math.ceil(excess / (plain * PROBE_SHARE))))


def drafter_due(costs: StepCosts, batch: int, expected: Callable[[int], float],
                deepest: int, left: int = 0, prefill_s: float | None = None,
                compiles: bool = False) -> bool:
    """Whether a row's model drafter should take its prompt now, the row decoding (or
    about to) in a batch of this many rows.  Alone, always.  In a batch, a verify step
    of width w yields expected(w - 1) tokens a row (`expected`: what the row's own
    policy expects a round of that depth to keep; `deepest`: the deepest it drafts) in
    t(B, w) seconds, a plain one 1 in t(B, 1); speculating saves the batch
    t(B, 1) - t(B, w) / expected(w - 1) a token, at best over the widths measured.
    Not due where that saving is nowhere above 0 (a loss at the acceptance it expects),
    nor where the batch's `left` tokens a row at that saving would not repay the
    drafters' prefill: `batch` rows each taking `prefill_s` seconds (this row's, by the
    drafter's measured cost), every row waiting on each.  Due where nothing says so (no
    settled plain time, no width up to deepest + 1 measured, no prefill cost measured).
    Pure.  A size judged a loss is probed again (`plan_step`) by rows that brought their
    drafters from a batch where they were due, or from decoding alone: lifting the wait
    for every row as a probe neared had the rows of a 16-client slot on this CPU take
    their drafters' prompts (28 chunks, 745 ms) for one probe step of 107 ms.

    A drafter's prefill is a forward per chunk of the prompt, each row's own, for drafts
    such a batch does not verify, or verifies for too few tokens to repay: measured
    through the batching bench on an H100 (demo pair, 8 clients), the default seat's
    drafters took 43-229 ms of slots of 0.8-1.5 s while it verified 1-2 steps a slot; on
    this project's 2-core CPU at 16 clients, where its batches verified, it served 0.87x
    its plain path's tokens/s with time to first token 5.34 s against 4.89 s.  A row
    passed over drafts by lookup meanwhile, and its drafter catches up (prompt, then
    every answer token since: `seatd.drafters.ModelDrafter.plain`) once it is due."""
    if batch <= 1:
        return True
    if not speculates(batch, compiles):
        return False
    c = size_class(batch)
    plain = costs.time(batch, 1)
    verifies = {w: t for (k, w), t in costs.seconds.items() if k == c and 1 < w <= deepest + 1}
    if plain is None or not costs.settled(batch) or not verifies:
        return True
    saving = max(plain - t / expected(w - 1) for w, t in verifies.items())
    if saving <= 0:
        return False
    return prefill_s is None or left * saving >= batch * prefill_s


def catch_up_due(seconds: Sequence[float] | None, expected: Callable[[int], float],
                 deepest: int, left: int, prefill_s: float | None) -> bool:
    """Whether a row's model drafter, passed over while its batch stepped plain, should
    catch up now that the row decodes alone (its prompt, then every answer token since:
    `prefill_s` seconds at the drafter's measured cost).  The row's own policy holds a
    round's time at each depth (`seconds`, 0: a plain token) and what a round keeps
    (`expected`); its best round saves seconds[0] - seconds[d] / expected(d) a token,
    at depths 1..deepest (those the policy holds).  Due where the row's `left` tokens at
    that saving repay the catch-up, or where nothing says otherwise (no times, no round
    to judge, no prefill cost measured).  A row left alone with a few tokens to go thus
    finishes plain (by lookup where that pays) instead of prefilling its whole context
    into a drafter for them: the same test a batch's rows pass (`drafter_due`), at the
    row's own figures.  A row that begins alone always takes its drafter with its
    prompt (its probes keep the seat's figures current).  Pure."""
    if seconds is None or prefill_s is None or len(seconds) < 2 or seconds[0] <= 0:
        return True
    top = min(deepest, len(seconds) - 1)
    if top < 1:  # no round to judge: nothing says otherwise
        return True
    saving = max(seconds[0] - seconds[d] / expected(d) for d in range(1, top + 1))
    return left * saving >= prefill_s


def plan_step(wants: Sequence[tuple[int, float]], batch: int, costs: StepCosts,
              joining: bool = False, compiles: bool = False) -> list[int]:
    """The draft depth of each row for the next step (all zeros: a plain step)."""
    depths = [d for d, _ in wants]
    if not any(depths):
        return [0] * len(wants)
    if batch <= 1:
        return depths
    if joining or not speculates(batch, compiles):
        return [0] * len(wants)
    width = 1 + max(depths)
    plain, verify = costs.time(batch, 1), costs.time(batch, width)
    if plain is None or not costs.settled(batch):
        return [0] * len(wants)  # measure the plain step first
    if verify is None:
        return depths  # never measured at this size: try it
    gain = sum(e if d else 1.0 for d, e in wants)
    if gain / verify > batch / plain:
        if costs.verify_since_plain.get(size_class(batch), 0) >= PROBE_EVERY:
            return [0] * len(wants)  # the plain time it wins against, measured again
        return depths
    if costs.plain_since_probe.get(size_class(batch), 0) >= probe_every(plain, verify):
        return depths
    return [0] * len(wants)


@dataclass(frozen=True)
class StepPlan:
    """A lane's next decode step, decided before it runs: each row's draft depth (all 0:
    a plain step), and the rows that wished to draft but step plainly, with the reason
    their reports take (`prompt_joining`, `batch_not_profitable`)."""

    depths: tuple[int, ...]
    declines: tuple[tuple[int, str], ...] = ()

    @property
    def verify(self) -> bool:
        return any(self.depths)

    @property
    def width(self) -> int:
        """Tokens each row's forward takes: 1 + the deepest draft."""
        return 1 + max(self.depths, default=0)


def decide_step(wants: Sequence[tuple[int, float]], batch: int, costs: StepCosts,
                joining: bool = False, compiles: bool = False) -> StepPlan:
    """`plan_step`'s depths as a plan, with the rows it passed over named.  Pure."""
    depths = tuple(plan_step(wants, batch, costs, joining, compiles))
    if any(depths) or not any(d for d, _ in wants):
        return StepPlan(depths)
    why = JOINING if joining else NOT_PROFITABLE
    return StepPlan(depths, tuple((b, why) for b, (d, _) in enumerate(wants) if d))


def speculates(batch: int, compiles: bool) -> bool:
    """Whether a step of `batch` rows may verify at all: a row alone always (a seat's
    warm-up built each of its shapes: `seatd.warm_shapes`); a batch, except on a
    backend that builds each new shape on first use (`compiles`: CUDA).  There a batch's
    verify step meets shapes no warm-up can list ahead: its rows, its block's width, and
    each segment's buffer, whose size is the joining prompt's own.  Traced through the
    batching bench on an H100 (demo pair), such a step took 27-110 ms against a few ms
    once built, and builds came back as capacities changed: in a 2-client slot four
    verify steps took 281 ms of its 598, and with its drafters' prefills (taken for
    the verifies to come) the default seat served 0.46x / 0.64x / 0.73x / 0.59x its
    plain path's tokens/s at 2 / 4 / 8 / 16 clients.  The step costs cannot judge it
    either: a try's time is the build's, so the first try of every width at every size
    is lost.  So a batch there steps plain, and its rows' drafters take no prompt while
    they are in one (`drafter_due`); a row left alone speculates again where the tokens
    it has left repay its drafter's catch-up (`catch_up_due`).  Pure."""
    return batch <= 1 or not compiles


# A decoding row's first steps set no pace of its own yet (`paced`): its client has a
# token or a few.
PACE_STEPS = 8


def paced(arrived: int, began: Sequence[int]) -> bool:
    """Whether a joining group's prefill must keep to the decoding rows' pace: some row
    had decoded PACE_STEPS steps when the group's latest request reached the engine
    (`arrived`, `began`: the engine's count of steps that decoded, whatever lanes they
    held, then and when each decoding row began).  Requests that reached it before any
    decoding row was that far in are one cohort: no client of theirs has a pace of its
    own yet, so the rest of the cohort prefills in whole chunks (as a server that
    prefills every waiting prompt before decoding does) and the batch fills at once,
    instead of each prompt crawling in beside rows that then finish alone.  Not only
    the rows that began after it: clients started together reach the engine a few of
    its steps apart (their requests cross the proxy one by one), and the first to
    arrive begins decoding before the others are in.  Traced through the batching bench
    on an H100 (demo, 8 clients), they arrived within 4 steps of the first's
    beginning; held to its pace (a prefill step costs 3.5 ms there, half a decode
    step's share but its fixed part), the rest of the cohort crawled in over 30
    prefill steps of a few tokens and reached its first token after 250-400 ms.  The
    price: a long prompt of that cohort prefills in whole chunks while its first rows
    have their first few tokens.  Counts, never a clock.  Pure."""
    return any(arrived - b >= PACE_STEPS for b in began)


def ride_tokens(ride: int | None, own: int, limit: int, n: int, first: int) -> int:
    """Prompt tokens that ride a step of `n` tokens per row (`seatd.rows_cache.Rider`),
    in whole rows of `n`: as many as the step's budget holds by what riding was measured
    to cost (`ride`; None, never measured: `first`), within `limit` (the prompt's next
    cut), at least one row.  0, and the chunk takes a forward of its own, where one row
    of `n` crosses the limit or a forward of its own fits more tokens in the same budget
    (`own`)."""
    if limit < n or n < 1:
        return 0
    if ride is not None and own > ride:
        return 0
    want = first if ride is None else ride
    return max(1, min(want, limit) // n) * n

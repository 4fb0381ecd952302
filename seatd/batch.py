"""The seat's batch engine: every active request is a row of one forward per step.

Runs on the worker's MLX thread, one step at a time:

    admit     requests from the queue while the batch has room (`max_batch`) and the
              seat's KV budget holds their cache (`seatd.kv_budget`);
    prefill   one forward over a group of joining rows at one offset, their caches
              stacked (`seatd.prefill_rows`): a chunk of each prompt (on the
              `PREFILL_CHUNK` grid, whole chunks for a row alone), between the others'
              steps, within a measured time per step; or a prompt joining rows that
              decode rides their step (`_board`).  A chat's prefill ends at its
              answer's header, whose few tokens its lane's steps feed it one a step
              (`seatd.prefill_rows.join_point`): a cohort's rows join together;
    decode    one forward over every decoding row of a lane: plain (one token per row,
              the next step scheduled before this one's tokens are read) or a verify
              step (rows that draft feed their block, the others one token, padded);
    leave     rows that finished, were cancelled or failed leave the batch.

Each row has its own sampling parameters and draws (`seatd.sampling`: a seeded row's
noise is keyed by its own seed and answer position, so its neighbours never change
its randomness), its own stops and budget (`seatd.answer`), its own drafter and
counters.  A row's error ends that row only: the batch goes on without it.  A row's
model drafter takes the prompt as the row does, alone always, in a batch only where a
verify step of its batch's size was not measured to lose at what the row's policy
expects a round to keep, nor to save too little over the row's budget to repay the
batch's drafter prefills at their measured cost (`seatd.batch_policy.drafter_due`); it
catches up when that changes, or when the row is left alone with tokens enough to repay
it at what its policy's rounds save (`catch_up_due`), drafting by lookup meanwhile.

A row may shape its logits (`seatd.shaping`: a grammar's mask, penalties, logit bias),
identically in a plain step, at every position of a verified block and in its drafter's
proposal; a row with nothing to shape has no `Shaper` and costs nothing.  A row under a
grammar has its token read (and consumed into the grammar) before its next step, and a
draft is cut at its first token the grammar forbids.  Rows that ask for
log-probabilities get them from their raw logits at each token taken.

A prompt that joins rows already decoding is prefilled at their pace: a chunk per
step, so that their inter-token gaps grow by a bounded share.  A forward of its own
reads every weight again (on this CPU 20 ms of a 7-row step's 50, on a GPU most of a
decode step), so where the lane's model can (`seatd.rows_cache.Rider`, probed) the chunk
rides the rows' own step instead: its tokens are extra rows of the same forward,
`rows x n` tokens for a step of `n` tokens per row, writing the prompt's own cache and
attending to it causally.  How many tokens ride is measured, not assumed: what riding
tokens were measured to add to the rows' steps, per token
(`seatd.prefill_rows.RideCost`), and as many ride as fit the same share of the rows'
step time; where a forward of the prompt's own fits more in it, by its measured cost,
the chunk takes that instead (`ride_tokens`).  A prompt that cannot ride (a solo row,
a cohort of several, a recurrent model, a step of a width never measured) takes a
forward of its own.

Whether a step speculates is decided per step (`seatd.batch_policy`): alone, a row
follows its request's adaptive depth as a single request does; in a batch, a verify
step must beat a plain one at this batch size by the seat's measured step times, or
the rows decline with `batch_not_profitable`, and while a prompt joins at the rows'
pace the batch's steps are plain (`prompt_joining`).  On a backend that builds each new
shape on first use (`COMPILING`: CUDA) a batch steps plain (`batch_not_profitable`:
`seatd.batch_policy.speculates`).

The worker hands the engine prepared requests and reads what became of them as events
from its outbox (`seatd.engine_io`: `Work` in; `Started`, `Text`, `Ended` out); what
the seat decides as a request is admitted (its cached prefix, its speculation plan) is
the engine's `Admission`.  Nothing here calls up into the worker.

A log line for one row names its request (`request_id`), a line about several rows
theirs (`request_ids`); what a row's admission and its end write (the prompt cache's
lines among them) is bound to that row's `request_id` (`_naming`).  The thread's own
bindings name the seat (`shared.threads.bound_pool`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog

from seatd import device_probe, prefill_rows, recurrent
from seatd.adaptive import (
    LOOKUP,
    MODEL,
    PLAIN,
    DepthStats,
    RoundPolicy,
    observe,
    park_tokens,
)
from seatd.answer import Answer
from seatd.backend import backend
from seatd.batch_policy import (
    ALPHA,
    NOT_PROFITABLE,
    StepCosts,
    StepPlan,
    catch_up_due,
    decide_step,
    drafter_due,
    paced,
    ride_tokens,
    speculates,
)
from seatd.drafter_choice import JUDGE_TOKENS, Choice, choose, trusts
from seatd.drafters import LookupDrafter, ModelDrafter
from seatd.engine_io import Admission, Ended, Fixed, Outbox, RowCancelled, Started, Text, Work
from seatd.engine_types import (
    PREFILL_CHUNK,
    DecodeResult,
    SpecReport,
    Speculation,
    make_cache,
)
from seatd.idle_trim import IdleTrim
from seatd.kv_budget import KVBudget
from seatd.moving_average import moving
from seatd.prefill_rows import (
    KV_LAYERS,
    PrefillCost,
    RideCost,
    join_point,
    padded,
    stack,
    stackable,
    take,
    unpaced_tokens,
)
from seatd.rows_cache import SLACK, OneRow, Rider, RowsCache, lane_cache
from seatd.rows_drafter import Ask, RowsDrafter
from seatd.sampling import Chained, Draws, Keyed, draws_for, filter_logits, keyed_noise
from seatd.shaping import Matcher, Shaper, logprob_arrays, token_logprobs
from seatd.verify import judge
from shared.protocol import SamplingParams, TokenLogprob

log = structlog.get_logger()

# Beside decoding rows a prefill step may take this share of their step time: their
# inter-token gaps grow by less than that while a prompt joins.  Half, not more: their
# p99 gap is to stay under twice what it was, and steps jitter by a third at p99 on a
# busy machine (1.5 x 1.3 < 2); a riding prompt's tokens cost no fixed part, so half a
# step still moves a long prompt on.
PREFILL_SHARE = 0.5
PREFILL_FLOOR = 8  # the fewest prompt tokens per row a prefill step takes
# Backends measured to build each new shape on first use: a batch there steps plain
# (`seatd.batch_policy.speculates`).  Metal was not measured here (no Apple GPU on
# hand): its batches speculate by their measured step costs, as the CPU's do.
COMPILING = ("cuda",)
TEMPERATURE_SETS = 64  # sets of rows' temperatures kept on the device (`_temperatures`)


@contextmanager
def _naming(work: Work) -> Iterator[None]:
    """Lines written meanwhile (its admission, the prompt cache as it ends, a lane made
    for it) name the row's request."""
    tokens = structlog.contextvars.bind_contextvars(request_id=work.request.request_id)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


def lane_key(work: Work) -> str:
    """Rows of one KV mode batch together; a solo row has a lane of its own."""
    if work.request.solo:
        return f"{work.kv}/solo/{work.request.request_id}"
    return work.kv


@dataclass
class Drafting:
    """A row's speculation as it goes, round by round: the engine's own state of it
    (how the request may speculate, decided before it started, is `Work.spec`)."""

    speculating: bool = False
    drafter_in: bool = False  # its drafter has the prompt
    last_kept: int = 0
    by_lookup: bool = False  # this round's drafts come from its lookup drafter
    lookup_key: int = 0  # the match class its last lookup round drafted from (match_key)
    drafted: int = 0  # tokens drafted in its last verify step
    # A lookup match passed over: (its match class, the context's length then, its
    # tokens), judged as the answer goes past it (`Engine._by_lookup`).
    shadow: tuple[int, int, list[int]] | None = None
    park_left: int = 0  # plain tokens left in a parked burst (`seatd.adaptive`)
    parks: int = 0  # parked bursts in a row whose probe did not bring it back to drafting
    probe: bool = False  # a probe round is due after the burst
    passed_over: bool = False  # its drafter was passed over in a batch: it lags the row


@dataclass(frozen=True)
class Fed:
    """A row's feed as one row of a plain step's sampled tokens: `feed` is
    `whole[b : b + 1]`.  Rows fed by one step, in its order, are gathered back as
    `whole` itself (`_gather`), not by a concatenation of one copy per row."""

    whole: mx.array
    b: int
    feed: mx.array


@dataclass
class Row:
    work: Work
    params: SamplingParams
    draws: Draws
    answer: Answer
    report: SpecReport
    feed: mx.array | None = None  # (1,) the token it is fed next
    # `feed` as row `b` of a plain step's tokens `whole` (`Fed`); stale once `feed` changes
    fed: Fed | None = None
    unread: bool = False  # `feed` is an answer token the host has not taken yet
    issued: int = 0  # answer tokens computed (taken or in flight)
    start: int = 0  # answer tokens before this seat's (a continued answer's prefix)
    draft: Drafting = field(default_factory=Drafting)
    shaper: Shaper | None = None  # None: nothing to shape (`seatd.shaping`)
    top: int | None = None  # log-probabilities asked for, with this many alternatives
    feed_lp: tuple[mx.array, ...] | None = None  # `logprob_arrays` of an unread feed
    lps: list[TokenLogprob] = field(default_factory=list)  # of answer.ids[start:]
    lp_sent: int = 0  # lps[:lp_sent] went out with their ids
    began: int = 0  # `Engine.decoded` as it began decoding (`batch_policy.paced`)
    beside: bool = False  # some forward of it held another request's rows (or prompt)
    # Where its prefill ends and it joins its lane (`prefill_rows.join_point`), and the
    # prompt tokens its lane's steps feed it after `feed`, their outputs dropped.
    join_at: int = 0
    prompt_left: list[int] = field(default_factory=list)

    @property
    def grammar(self) -> Matcher | None:
        return self.shaper.grammar if self.shaper is not None else None

    @property
    def rid(self) -> str:
        return self.work.request.request_id

    @property
    def solo(self) -> bool:
        return bool(self.work.request.solo)

    @property
    def lane(self) -> str:
        return lane_key(self.work)


@dataclass
class Group:
    """Joining rows prefilled by one forward: one lane, `done` prompt tokens each, their
    caches stacked along the batch axis in the order of `rows`.  A group `alone` (a solo
    row, a cache that cannot stack, a lane that cannot batch) never takes others."""

    lane: str
    rows: list[Row]
    cache: list[Any]
    done: int
    alone: bool = False


@dataclass
class Lane:
    """The rows of one KV mode decoding together, and their cache."""

    cache: RowsCache | OneRow
    rows: list[Row] = field(default_factory=list)
    step_s: float | None = None  # its steps' wall time, plain or verify: moving average
    drafter: RowsDrafter | None = None  # its rows' model drafters, drafting together
    drafter_off: bool = False  # their drafter model cannot batch, or the batch failed
    rode: Aboard | None = None  # its last plain step carried a prompt, timed by the next
    # (rows, tokens per row) of its last step; None: a prefill forward ran since, and
    # the next plain step waits on that, not on its forerunner's forward
    last: tuple[int, int] | None = None


@dataclass
class Aboard:
    """A prompt that rode a step: its group, the tokens that rode; what the step took
    beyond the rows' own cost (a plain step's forward is timed by the step after it,
    which waits for it) and what the prompt's own bookkeeping took after it
    (`Engine._ridden`)."""

    group: Group
    tokens: int
    added: float | None = None
    host: float | None = None


@dataclass(frozen=True)
class Drained:
    """What an engine counted between two drains (`Engine.drain`): decode steps at each
    batch size and their time in microseconds (each step whole: its plan, forward and
    bookkeeping; a prompt's prefill forward between steps is not theirs); and calls of
    each part of the engine's working time (`seatd.counters.PARTS`) and their time in
    microseconds (together, every working step's whole time); and the plain decode steps'
    time by stage (`seatd.counters.STAGES`), in microseconds."""

    steps: dict[int, int]
    step_us: dict[int, int]
    part_calls: dict[str, int]
    part_us: dict[str, int]
    stage_us: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, model: Any, tokenizer: Any, context_length: int, width: int,
                 max_batch: int, budget: KVBudget, admission: Admission | None = None,
                 outbox: Outbox | None = None, compiles: bool | None = None) -> None:
        self.model = model
        # Whether this backend builds each new shape on first use (None: by `COMPILING`)
        self.compiles = backend() in COMPILING if compiles is None else compiles
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.width = width
        self.max_batch = max_batch
        self.budget = budget
        self.admission: Admission = admission or Fixed()
        self.outbox = outbox or Outbox()  # what became of each request, in order
        self.tokens = 0  # answer tokens taken, every row's: the seat's progress
        self.inbox: deque[Work] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.joining: list[Row] = []
        self.groups: list[Group] = []
        self.lanes: dict[str, Lane] = {}
        self.costs = StepCosts()
        # A model drafter's prefill, seconds a prompt token (moving), and how many
        # prefills it averages (`_drafter_took`): what a row's drafter costs to take in
        self.drafter_rate: float | None = None
        self.drafter_seen = 0
        self.stopped = False
        self.batch_sizes: dict[int, int] = {}  # steps seen at each batch size
        self.batch_us: dict[int, int] = {}  # ... and their time, in microseconds
        self.part_calls: dict[str, int] = {}  # calls of each part since the last drain
        self.part_us: dict[str, int] = {}  # ... and their time, in microseconds
        self._parted = 0.0  # seconds counted into parts, ever (a step's `other` is the rest)
        # A plain step's time by stage (`_plain_step`): counted since the last drain, and
        # the last step's own until its part is counted (this thread's alone, no lock)
        self.stage_us: dict[str, int] = {}
        self._staged: dict[str, float] = {}
        self._waited = 0.0  # seconds the host waited for tokens (`_read`), ever
        self._drafting = 0.0  # seconds drafters took their prompts, ever (not their step's)
        self.kv_bytes = 0  # the batch's KV now, refreshed after every step
        self.prefill_cost = PrefillCost()
        # Riding (`_board`): the group offered to its lane's next step, the prompt that
        # rode this step (None: none did), and what riding tokens add to a step.
        self._offer: Group | None = None
        self._aboard: Aboard | None = None
        self.ride_cost = RideCost()
        # Steps that decoded (any lanes), as requests reach the engine and rows begin to
        # decode (read on any thread: an int): how far in the decoding rows were when a
        # request arrived (`batch_policy.paced`).
        self.decoded = 0
        # the device's copies of rows' temperatures, by the rows' temperatures in order
        self._temps: dict[tuple[float, ...], tuple[mx.array, mx.array]] = {}
        # Work for the thread when no request has any (`seatd.warm_shapes.Warming.step`):
        # one short step a call, False once done.  A request then waits one such step.
        self.idle: Callable[[], bool] | None = None
        # MLX's freed buffers handed back after a pause (`seatd.idle_trim`), timed by
        # `clock`; `on_trim` is told (on this thread) each time it happened.
        self.trim = IdleTrim()
        self.clock: Callable[[], float] = time.monotonic
        self.on_trim: Callable[[], None] | None = None
        # After a step or a prefill failed, whether the device still computes
        # (`seatd.device_probe`): where it does not, every row ends with the error, the
        # thread stops and `on_device_lost` is told (on this thread), for the worker to
        # exit and be started afresh.  Unset (the warm-up, a bench), nothing is probed.
        self.probe: Callable[[], None] = device_probe.probe
        self.on_device_lost: Callable[[BaseException], None] | None = None

    # -- the worker's side (any thread): `seatd.engine_io` ----------------------

    def submit(self, work: Work) -> None:
        work.arrived = self.decoded
        with self.lock:
            self.inbox.append(work)
        self.wake.set()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    @property
    def active(self) -> list[str]:
        rows = [r.rid for r in self.joining]
        for lane in list(self.lanes.values()):
            rows.extend(r.rid for r in lane.rows)
        return rows

    def drain(self) -> Drained:
        """What the engine counted since the last drain, taken at one moment."""
        with self.lock:
            out = Drained(self.batch_sizes, self.batch_us, self.part_calls, self.part_us,
                          self.stage_us)
            self.batch_sizes, self.batch_us, self.part_calls, self.part_us = {}, {}, {}, {}
            self.stage_us = {}
        return out

    def _part(self, part: str, seconds: float) -> None:
        """`seconds` of the engine's working time into `part` (`seatd.counters.PARTS`);
        the caller holds `lock`."""
        self._parted += seconds
        self.part_calls[part] = self.part_calls.get(part, 0) + 1
        self.part_us[part] = self.part_us.get(part, 0) + round(1e6 * max(0.0, seconds))

    # -- the MLX thread ---------------------------------------------------------

    def run(self) -> None:
        while not self.stopped:
            try:
                busy = self.step()
            except Exception as exc:  # never lose the thread: end what it held, go on
                log.exception("engine_step_failed", request_ids=self.active)
                self._fail_all(exc)
                self._check_device(exc)
                busy = True
            if not busy and self.idle is not None:
                busy = self._idle_step(self.idle)
            if busy:
                self.trim.busy()
                continue
            if self.trim.idle(self.clock()):
                self._trim()
            self.wake.wait(0.05)
            self.wake.clear()

    def _check_device(self, error: BaseException) -> None:
        """After `error` failed a step or a prefill: where the device no longer
        computes, the rows still held end with it and the engine stops
        (`seatd.device_probe`)."""
        if self.on_device_lost is None or self.stopped:
            return
        lost = device_probe.broken(self.probe)
        if lost is None:
            return
        log.error("device_lost", error=repr(error), probe=repr(lost))
        self._fail_all(error)
        self.stopped = True
        self.on_device_lost(lost)

    def _trim(self) -> None:
        """MLX's freed buffers back to the device (`seatd.idle_trim`); a failure is
        logged, never the engine's."""
        try:
            held = mx.get_cache_memory()
            mx.clear_cache()
            log.info("mlx_cache_trimmed", freed_mb=round(held / 2**20, 1))
            if self.on_trim is not None:
                self.on_trim()
        except Exception as exc:
            log.warning("mlx_cache_trim_failed", error=repr(exc))

    def _idle_step(self, idle: Callable[[], bool]) -> bool:
        """One step of the idle work, between requests' steps; its end, or its error
        (logged: it costs what it was for, never a request), ends it."""
        try:
            if idle():
                return True
        except Exception as exc:
            log.warning("idle_work_failed", error=repr(exc))
        self.idle = None
        return False

    def _fail_all(self, error: BaseException) -> None:
        rows = [*self.joining, *(r for lane in self.lanes.values() for r in lane.rows)]
        for lane in self.lanes.values():
            lane.rows = []
        self.joining, self.groups, self.lanes = [], [], {}
        for row in rows:
            if not row.answer.closed:
                self._finish(row, error)

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        began, parted = time.perf_counter(), self._parted
        worked = self._step()
        if worked:  # what its parts did not count
            with self.lock:
                self._part("other", time.perf_counter() - began - (self._parted - parted))
        return worked

    def _step(self) -> bool:
        self._admit()
        self._cancels()
        worked = False
        self._offer, self._aboard = self._rider(), None
        if self.groups and self._offer is None:
            self._prefill()
            worked = True
        decoding = False
        for lane in list(self.lanes.values()):
            if lane.rows and not self.stopped:  # stopped: a lost device ended every row
                self._decode(lane)
                worked = decoding = True
        if decoding:  # once a step, however many lanes it decoded
            self.decoded += 1
        if self._offer is not None and not self.stopped:
            worked = True
            if self._aboard is None:  # it could not ride: a forward of its own
                self._prefill()
            else:
                self._ridden(self._aboard)
        self._offer = None
        for kv, lane in list(self.lanes.items()):
            if not lane.rows and not any(r.lane == kv for r in self.joining):
                del self.lanes[kv]
        self.kv_bytes = sum(lane.cache.nbytes for lane in self.lanes.values()) + sum(
            _nbytes(g.cache) for g in self.groups)
        return worked

    # -- admission --------------------------------------------------------------

    def rows(self) -> int:
        return len(self.joining) + sum(len(lane.rows) for lane in self.lanes.values())

    def _admit(self) -> None:
        while True:
            with self.lock:
                if not self.inbox:
                    return
                work = self.inbox[0]
            with _naming(work):
                if not self._admit_one(work):
                    return

    def _admit_one(self, work: Work) -> bool:
        """The queue's first request admitted when it fits; False when it waits (the
        batch or its KV budget is full)."""
        if work.cancel.is_set():
            self._pop(work)
            self._end_unstarted(work, RowCancelled())
            return True
        if self.rows() >= self.max_batch or self._lane_full(lane_key(work)):
            return False
        if not self.budget.admit(work.reserve, alone=self.rows() == 0):
            return False  # waits for a row to leave; the proxy's queue clock runs meanwhile
        self._pop(work)
        try:
            admitted = self.admission.admit(work)
        except Exception as exc:
            log.exception("row_begin_failed", request_id=work.request.request_id)
            self.budget.release(work.reserve)
            self._end_unstarted(work, exc)
            return True
        work.resume, work.spec, work.finish = admitted.resume, admitted.spec, admitted.finish
        self.outbox.put(Started(work.rid, time.monotonic()))
        self._start(work)
        return True

    def _lane_full(self, kv: str) -> bool:
        """A lane that cannot batch (`OneRow`) takes its next row when its row left."""
        lane = self.lanes.get(kv)
        if lane is None or lane.cache.capacity is None:
            return False
        rows = len(lane.rows) + sum(1 for r in self.joining if r.lane == kv)
        return rows >= lane.cache.capacity

    def _pop(self, work: Work) -> None:
        with self.lock:
            if self.inbox and self.inbox[0] is work:
                self.inbox.popleft()

    def _end_unstarted(self, work: Work, error: BaseException) -> None:
        self.outbox.put(Ended(work.rid, None, error, len(work.prompt)))

    def _start(self, work: Work) -> None:
        params = work.request.params
        # A continued answer (`Generate.prefix`): the worker put the tokens the client
        # already has after the prompt; the budget counts the whole answer, and answer
        # positions (keyed draws, drafts) start after them, as in the uninterrupted one.
        prefix = list(work.request.prefix_ids or ())
        n_prompt = len(work.prompt)
        budget = min(params.max_tokens,
                     max(self.context_length - n_prompt + len(prefix), 0))
        report = SpecReport()
        shaper = Shaper.for_row(params, self.width, work.prompt, prefix, work.grammar)

        def send(text: str, count: int) -> None:
            if work.first_token_at is None:
                work.first_token_at = time.monotonic()
            fresh = row.answer.fresh_ids()
            lps: Sequence[TokenLogprob] = ()
            if row.top is not None:
                lps = row.lps[row.lp_sent : row.lp_sent + len(fresh)]
                row.lp_sent += len(fresh)
            self.outbox.put(Text(work.rid, text, count, report.state, tuple(fresh),
                                 tuple(lps)))

        row = Row(work, params, draws_for(params, self.width),
                  Answer(self.tokenizer, params, budget, send, prefix=prefix,
                         sent=work.request.prefix or ""), report)
        row.issued = row.start = len(prefix)
        row.shaper, row.top = shaper, params.logprobs
        spec = work.spec
        if spec is not None:
            if spec.decline is not None or spec.drafter is None or spec.depth == 0:
                report.state = f"declined:{spec.decline or 'not_profitable'}"
            elif shaper is not None and not getattr(spec.drafter, "shapes", False):
                report.state = "declined:constrained"  # a drafter that cannot shape
            else:
                report.state = "declined:no_proposal"
                begin = getattr(spec.drafter, "begin", None)
                try:
                    if begin is not None:
                        begin(work.prompt)
                    if spec.lookup is not None:
                        spec.lookup.start(work.prompt)
                    row.draft.speculating = True
                except Exception as exc:  # a drafter's fault is a decline
                    log.warning("drafter_failed", error=repr(exc),
                                request_id=work.request.request_id)
                    report.state = "declined:drafter_error"
        resume = work.resume
        if resume is not None and resume.cache is not None and resume.start > 0:
            cache, done = resume.cache, resume.start
        else:
            cache, done = make_cache(self.model, work.kv), 0
        row.join_at = join_point(n_prompt, resume.cuts if resume is not None else (),
                                 PREFILL_CHUNK)
        if row.join_at < done:  # a resumed prefix past it: never, by `join_point`'s rule
            row.join_at = n_prompt - 1
        if budget <= len(prefix) or row.answer.done:
            self._finish(row, None)
            return
        self.joining.append(row)
        if row.lane not in self.lanes:
            self.lanes[row.lane] = Lane(lane_cache(self.model, work.kv))
        alone = (row.solo or self.lanes[row.lane].cache.capacity is not None
                 or not stackable(cache))
        self.groups.append(Group(row.lane, [row], cache, done, alone))

    # -- prefill ----------------------------------------------------------------

    def _prefill_time(self, group: Group | None = None) -> float | None:
        """The time one prefill step may take beside decoding rows: PREFILL_SHARE of
        their steps' time, so their inter-token gaps grow by less than that, or more where
        more rows wait to join than decode (rows per row: a row waiting has no token at
        all yet, and prompts arriving together would otherwise join one by one at a
        crawl); None with no row decoding, or none that was decoding when the group's
        rows arrived (`batch_policy.paced`): whole chunks, as a request alone prefills."""
        decoding = [lane for lane in self.lanes.values() if lane.rows]
        if not decoding:
            return None
        if group is not None and not paced(max(r.work.arrived for r in group.rows),
                                           [r.began for lane in decoding for r in lane.rows]):
            return None
        waiting = len(self.joining) / sum(len(lane.rows) for lane in decoding)
        return max(PREFILL_SHARE, waiting) * sum(self._pace(lane) for lane in decoding)

    def _pace(self, lane: Lane) -> float:
        """A decoding lane's step time, as a joining prompt's share is sized: its plain
        step at its size where that is measured (settled), since its steps are plain
        while a prompt joins at its pace (`seatd.batch_policy.plan_step`); else its
        steps' own time, verify steps included (`Lane.step_s`: a lane that never took a
        plain step at its size still gives a prompt room).  Sized on a speculating
        lane's average, a chunk's share was of a step up to twice a plain one: through
        the batching bench on this project's 2-core CPU (demo pair, 7 rows decoding, a
        1,493-token prompt arriving), the default seat's rows' inter-token p99 went from
        120-140 ms to 266-273 ms while it joined, the plain seat's from 47-53 to 84-91.
        With this sizing, in a run of that scenario alone (whose rows verified few steps
        before it came): 70-77 ms to 148-152 against the plain seat's 64-68 to 105-114;
        the rest of that difference was not traced."""
        B = len(lane.rows)
        plain = self.costs.time(B, 1) if self.costs.settled(B) else None
        return plain if plain is not None else lane.step_s or 0.0

    # -- riding ---------------------------------------------------------------

    def _rider(self) -> Group | None:
        """The group that rides its lane's next step: the one the next prefill would
        take, where it is one row keeping to the decoding rows' pace, in a lane whose
        model can carry it (`RowsCache.riding`)."""
        if not self.groups:
            return None
        self._merge()
        group = min(self.groups, key=lambda g: g.done)
        lane = self.lanes.get(group.lane)
        if (len(group.rows) != 1 or group.alone or group.rows[0].work.fault
                or lane is None or not lane.rows or not isinstance(lane.cache, RowsCache)
                or not lane.cache.riding
                or any(type(c) not in KV_LAYERS for c in group.cache)
                or self._prefill_time(group) is None):
            return None
        return group

    def _board(self, lane: Lane, block: mx.array, n: int) -> tuple[mx.array, Rider | None]:
        """The step's input with the offered prompt's next tokens as rows of `n` after
        the batch's, and its `Rider`; the block as it was where none rides."""
        group = self._offer
        if group is None or self.lanes.get(group.lane) is not lane or self._aboard:
            return block, None
        if self.costs.time(len(lane.rows), n) is None:
            # A step whose own cost is not known yet (a verify width tried for the first
            # time) carries no prompt: a ride is measured against that cost, and a step
            # that carries one does not measure it.
            return block, None
        seconds = self._prefill_time(group) or 0.0
        ride = self.ride_cost.tokens_within(seconds)
        own = self.prefill_cost.tokens_within(seconds, group.done, 1, 0) or 0
        m = ride_tokens(ride, own, self._chunk(group, PREFILL_CHUNK), n, PREFILL_FLOOR)
        if m == 0:
            return block, None
        row = group.rows[0]
        tokens = mx.array(row.work.prompt[group.done : group.done + m], dtype=mx.uint32)
        self._aboard = Aboard(group, m)
        row.beside = True
        for r in lane.rows:
            r.beside = True
        return (mx.concatenate([block, tokens.reshape(m // n, n)]),
                Rider(group.cache, group.done, m // n))

    def _ridden(self, aboard: Aboard) -> None:
        """After the step a prompt rode: its tokens are in its cache; what they added to
        the step, and what its own bookkeeping took (its drafter's prefill), is their
        cost (`ride_cost`)."""
        group, m = aboard.group, aboard.tokens
        started = time.perf_counter()
        try:
            self._advance(group, m, True)
        except Exception as exc:  # its own bookkeeping failed: the rows decoding go on
            log.exception("row_prefill_failed", request_ids=[r.rid for r in group.rows])
            self._end_group(group, exc)
        if not group.rows and group in self.groups:
            self.groups.remove(group)
        aboard.host = time.perf_counter() - started
        self._ride_measured(aboard)

    def _ride_measured(self, aboard: Aboard) -> None:
        if aboard.added is not None and aboard.host is not None:
            self.ride_cost.observe(aboard.tokens, aboard.added + aboard.host)

    def _row_tokens(self, group: Group) -> int:
        """Prompt tokens each row of this group may take in this step."""
        if group.alone and (group.rows[0].solo or not self._decoding()):
            return PREFILL_CHUNK  # a request alone, or a solo row whoever else decodes
        seconds = self._prefill_time(group)
        if seconds is None:  # nobody keeps a pace: enough to amortise the step's fixed part
            return unpaced_tokens(self.prefill_cost.fit(), len(group.rows), group.done,
                                  PREFILL_CHUNK, PREFILL_FLOOR)
        per_row = self.prefill_cost.tokens_within(seconds, group.done, len(group.rows),
                                                  PREFILL_FLOOR)
        return min(PREFILL_CHUNK, per_row or PREFILL_FLOOR)

    def _catch_up_tokens(self) -> int:
        """Prompt tokens a decoding row's drafter takes in one step: whole chunks for a
        row alone (it waits on nobody but itself)."""
        seconds = self._prefill_time()
        alone = sum(len(lane.rows) for lane in self.lanes.values()) <= 1 and not self.groups
        if seconds is None or alone:
            return PREFILL_CHUNK
        return min(PREFILL_CHUNK, self.prefill_cost.tokens_within(
            seconds, 0, 1, PREFILL_FLOOR) or PREFILL_FLOOR)

    def _decoding(self) -> bool:
        return any(lane.rows for lane in self.lanes.values())

    def _merge(self) -> None:
        """Groups of one lane that reached the same offset become one."""
        merged: list[Group] = []
        for g in self.groups:
            into = next((m for m in merged if not m.alone and not g.alone
                         and m.lane == g.lane and m.done == g.done), None)
            if into is None:
                merged.append(g)
                continue
            into.cache = stack([into.cache, g.cache])
            into.rows.extend(g.rows)
        self.groups = merged

    def _prefill(self) -> None:
        began, drafting = time.perf_counter(), self._drafting
        try:
            self._prefill_one()
        finally:
            with self.lock:
                self._part("prefill",
                           time.perf_counter() - began - (self._drafting - drafting))

    def _prefill_one(self) -> None:
        for lane in self.lanes.values():  # a forward of its own: their next plain steps
            lane.last = None  # wait on it, not on their forerunners (`_measured`)
        self._merge()
        group = min(self.groups, key=lambda g: g.done)  # the furthest behind: the others
        try:  # wait for it to catch up, and merge
            for row in [r for r in group.rows if r.work.fault]:
                self._drop_joining(group, row, RuntimeError(
                    "injected row fault (SANCTUM_FAULT_ROW)"))
            if any(r.work.device_fault for r in group.rows):
                raise RuntimeError("injected device fault (SANCTUM_FAULT_DEVICE)")
            if group.rows:
                self._prefill_group(group)
        except Exception as exc:  # this group's prefill failed: the other rows go on
            log.exception("row_prefill_failed", request_ids=[r.rid for r in group.rows])
            self._end_group(group, exc)
            self._check_device(exc)
        if not group.rows and group in self.groups:
            self.groups.remove(group)

    def _end_group(self, group: Group, error: BaseException) -> None:
        if group in self.groups:
            self.groups.remove(group)
        for row in group.rows:
            if row in self.joining:
                self.joining.remove(row)
            self._finish(row, error)

    def _chunk(self, group: Group, budget: int | None = None) -> int:
        """Tokens for every row of the group in this step: on the chunk grid, at no row's
        cut or keep point crossed, and no further than a group ahead of it (to merge);
        within `budget` (None: the prefill step's own, `_row_tokens`)."""
        done = group.done
        limits = [PREFILL_CHUNK - done % PREFILL_CHUNK,
                  self._row_tokens(group) if budget is None else budget]
        ends = []
        for row in group.rows:
            ends.append(row.join_at - done)
            resume = row.work.resume
            if resume is not None:  # its join point is its end: a padded forward passes it
                limits.extend(c - done for c in resume.cuts if done < c != row.join_at)
                if resume.keep is not None and done < resume.keep_at != row.join_at:
                    limits.append(resume.keep_at - done)
        if not group.alone:
            limits.extend(g.done - done for g in self.groups
                          if g.lane == group.lane and not g.alone and g.done > done)
        if budget is None and prefill_rows.paddable(group.cache):
            # one forward past the nearer ends where that costs less than their own
            return padded(ends, min(limits), self.prefill_cost.fit(), done)
        return min([*limits, *ends])

    def _prefill_group(self, group: Group) -> None:
        n = self._chunk(group)
        started = time.perf_counter()
        if n > 0 and len(group.rows) > 1:
            for r in group.rows:
                r.beside = True
        if n > 0:
            # a row whose prompt ends before the step's (`padded`) takes filler after it
            # (its own last prompt token again): none of its tokens attends to it, and
            # its cache is cut back to its prompt as it joins (`_advance`)
            block = mx.array([_filled(r.work.prompt[group.done : group.done + n], n)
                              for r in group.rows], dtype=mx.uint32)
            self.model(block, cache=group.cache)  # only the cache is evaluated: no logits
            mx.eval([c.state for c in group.cache])
        self._advance(group, n, self._decoding(), started)

    def _advance(self, group: Group, n: int, decoding: bool,
                 started: float | None = None) -> None:
        """The group's caches hold `n` more prompt tokens: keep points, the rows'
        drafters, and the rows whose prompts are in join their lane.  `started`: the
        prefill forward's start, for its cost (`prefill_cost`; a ride's is `_ridden`'s)."""
        group.done += n
        for b, row in enumerate(group.rows):
            resume = row.work.resume
            if resume is not None and resume.keep is not None and group.done == resume.keep_at:
                resume.keep(take(group.cache, b) if len(group.rows) > 1 else group.cache)
            elif resume is not None and resume.keep is not None \
                    and resume.keep_at == row.join_at < group.done:
                # kept at its join point, which a padded forward went past
                resume.keep(take(group.cache, b, row.join_at))
            # Nobody waits on it: the drafter takes whole chunks, as a request alone's.
            if self._drafter_due(row):
                self._drafter_prefill(row, max(n, PREFILL_FLOOR) if decoding else PREFILL_CHUNK)
        if n > 0 and started is not None:
            self.prefill_cost.observe(n * len(group.rows), group.done - n / 2,
                                      time.perf_counter() - started)
        ready = [b for b, r in enumerate(group.rows) if group.done >= r.join_at]
        if not ready:
            return
        rest = [b for b in range(len(group.rows)) if b not in ready]
        lane = self.lanes[group.lane]
        if len(ready) > 1 and isinstance(lane.cache, RowsCache) and lane.cache.joins_rows:
            # together, as one segment: the ready rows gathered (keys and values of each layer)
            # where some rows stay, else the buffer as it is
            rows = [group.rows[b] for b in ready]
            lane.cache.join_rows(prefill_rows.keep(group.cache, ready) if rest
                                 else group.cache, [r.join_at for r in rows])
            for row in rows:
                self.joining.remove(row)
                self._joined(row)
        else:
            for b in ready:
                row = group.rows[b]
                self.joining.remove(row)
                own = row.join_at  # past it: filler (`_prefill_group`)
                self._join(row, take(group.cache, b, own) if len(group.rows) > 1
                           or group.done > own else group.cache)
        group.cache = prefill_rows.keep(group.cache, rest) if rest else []
        group.rows = [group.rows[b] for b in rest]

    def _drop_joining(self, group: Group, row: Row, error: BaseException) -> None:
        """A joining row ends alone: the rest of its group goes on without it."""
        b = group.rows.index(row)
        rest = [i for i in range(len(group.rows)) if i != b]
        group.cache = prefill_rows.keep(group.cache, rest) if rest else []
        group.rows = [group.rows[i] for i in rest]
        self.joining.remove(row)
        self._finish(row, error)

    def _drafter_due(self, row: Row) -> bool:
        """Whether the row's model drafter takes its prompt now
        (`seatd.batch_policy.drafter_due`, in the batch of its lane's rows and those
        joining it, at what the row's own policy expects a round to keep); a row passed
        over reports why, unless its report already says otherwise."""
        spec = row.work.spec
        if spec is None or row.draft.drafter_in or not row.draft.speculating \
                or getattr(spec.drafter, "advance", None) is None:
            return True
        # the row is one of them: decoding in its lane, or joining it
        lane = self.lanes.get(row.lane)
        batch = (len(lane.rows) if lane is not None else 0) + sum(
            1 for r in self.joining if r.lane == row.lane)
        policy = spec.policy
        to_take = getattr(spec.drafter, "to_take", None)
        prefill_s = (self.drafter_rate * to_take
                     if self.drafter_rate is not None and to_take is not None else None)
        expected = policy.expected if policy is not None else spec.stats.expected_tokens
        left = row.answer.budget - row.issued
        if batch <= 1 and row.draft.passed_over:  # left alone: catch up where it repays
            due = catch_up_due(policy.seconds if policy is not None else None, expected,
                               spec.depth, left, prefill_s)
        else:
            due = drafter_due(self.costs, batch, expected, spec.depth, left, prefill_s,
                              self.compiles)
            row.draft.passed_over = row.draft.passed_over or not due
        if not due and row.report.state == "declined:no_proposal":
            row.report.state = f"declined:{NOT_PROFITABLE}"
        return due

    def _drafter_took(self, tokens: int, seconds: float) -> None:
        """A model drafter's prefill took `tokens` prompt tokens in `seconds`: its
        seconds a token, a moving average (`drafter_rate`)."""
        if tokens > 0:
            self.drafter_rate = moving(self.drafter_rate, seconds / tokens, ALPHA,
                                       self.drafter_seen)
            self.drafter_seen += 1

    def _drafter_prefill(self, row: Row, budget: int) -> bool:
        """The row's model drafter takes the prompt in step with the target (a row whose
        target prefill is in before its drafter's decodes plainly until it is); True
        when it has it (or the row does not speculate)."""
        spec = row.work.spec
        if row.draft.drafter_in or not row.draft.speculating or spec is None \
                or spec.drafter is None:
            return True
        advance = getattr(spec.drafter, "advance", None)
        began = time.perf_counter()
        try:
            if advance is None:
                spec.drafter.start(row.work.prompt)
                row.draft.drafter_in = True
            else:
                before, started = getattr(spec.drafter, "to_take", 0), time.perf_counter()
                row.draft.drafter_in = bool(advance(budget))
                self._drafter_took(before - getattr(spec.drafter, "to_take", 0),
                                   time.perf_counter() - started)
            return row.draft.drafter_in
        except Exception as exc:  # a drafter's fault is a decline
            log.warning("drafter_failed", error=repr(exc), request_id=row.rid)
            row.draft.speculating = False
            row.report.state = "declined:drafter_error"
            return True
        finally:  # its own part, not the prefill's or the step's it was taken in
            seconds = time.perf_counter() - began
            self._drafting += seconds
            with self.lock:
                self._part("drafter_prefill", seconds)

    def _join(self, row: Row, cache: list[Any]) -> None:
        self.lanes[row.lane].cache.join(cache, row.join_at)
        self._joined(row)

    def _joined(self, row: Row) -> None:
        """A row whose prompt is in its lane's cache up to its join point decodes from the
        next step: fed the rest of its prompt first, a token a step (`prompt_left`)."""
        work = row.work
        lane = self.lanes[row.lane]
        row.feed = mx.array([work.prompt[row.join_at]], dtype=mx.uint32)
        row.prompt_left = list(work.prompt[row.join_at + 1 :])
        row.unread = False
        row.began = self.decoded
        lane.rows.append(row)

    # -- decode -----------------------------------------------------------------

    def _draft_rows(self, lane: Lane) -> None:
        """Rows whose model drafter has the prompt draft together from now on (a lane
        that cannot batch, or a solo row's, drafts alone, as a request alone does)."""
        if lane.drafter_off or lane.cache.capacity is not None or any(r.solo for r in lane.rows):
            return
        ready: list[tuple[Row, ModelDrafter]] = []
        for row in lane.rows:
            spec = row.work.spec
            drafter = spec.drafter if spec is not None else None
            # Exactly ModelDrafter: a subclass may draft its own way.
            # A grammar's masks need each drafted token on the host: such a row drafts
            # alone, where its own drafter steps through them.
            if row.draft.speculating and row.draft.drafter_in \
                    and isinstance(drafter, ModelDrafter) \
                    and type(drafter) is ModelDrafter and row.grammar is None:
                ready.append((row, drafter))
        if lane.drafter is None and len(ready) < 2:
            return  # a row drafting alone keeps its own drafter, as a request alone
        for row, drafter in ready:
            if lane.drafter is None:
                lane.drafter = RowsDrafter.for_model(drafter.model)
                if lane.drafter is None:
                    lane.drafter_off = True
                    return
            if row.rid not in lane.drafter and lane.drafter.model is drafter.model:
                lane.drafter.join(row.rid, drafter)

    def _drafters_keep(self, lane: Lane) -> None:
        if lane.drafter is not None:
            lane.drafter.keep([r.rid for r in lane.rows if r.draft.speculating])
            if not lane.drafter.members:
                lane.drafter = None

    def _decode(self, lane: Lane) -> None:
        """One step of a lane, in three parts: plan it (`_plan`: each row's draft depth,
        from the rows' wishes and the seat's step costs), run its forward (a verify step
        or a plain one), then take what it measured into the seat's figures
        (`_measured`)."""
        B = len(lane.rows)
        begun, drafting = time.perf_counter(), self._drafting
        if B > 1:
            for r in lane.rows:
                r.beside = True
        if speculates(B, self.compiles):  # rows that cannot verify draft nothing together
            self._draft_rows(lane)
        # A row still fed its prompt (`Row.prompt_left`) takes plain steps, and so its lane's.
        plan = self._plan(lane) if not any(r.prompt_left for r in lane.rows) \
            else StepPlan((0,) * B)
        spec = lane.rows[0].work.spec if B == 1 else None
        costs = spec.costs if spec is not None else None
        split = costs is not None and plan.depths[0] > 0 and costs.due()
        parts: tuple[float, float, int] | None = None
        started = time.perf_counter()
        try:
            if plan.verify:
                parts = self._verify_step(lane, list(plan.depths), started if split else None)
            else:
                self._plain_step(lane)
        except Exception as exc:
            # A forward over the batch failed: every row in it ends; the worker lives.
            log.exception("batch_step_failed", rows=B, request_ids=[r.rid for r in lane.rows])
            for row in lane.rows:
                self._finish(row, exc)
            lane.rows = []
            lane.cache.drop([])
            lane.drafter = None
            self._check_device(exc)
        else:
            self._measured(lane, B, plan, parts, time.perf_counter() - started)
            self._leave(lane)
        elapsed = time.perf_counter() - begun
        took = round(1e6 * elapsed)
        with self.lock:  # the step, its time and its part, counted together
            self.batch_sizes[B] = self.batch_sizes.get(B, 0) + 1
            self.batch_us[B] = self.batch_us.get(B, 0) + took
            self._part("verify" if plan.verify else "plain",
                       elapsed - (self._drafting - drafting))
            for stage, seconds in self._staged.items():
                self.stage_us[stage] = self.stage_us.get(stage, 0) + round(1e6 * seconds)
        self._staged = {}

    def _plan(self, lane: Lane) -> StepPlan:
        """The lane's next step (`seatd.batch_policy.decide_step`); a row whose wish to
        draft it passes over reports why, unless its report already says otherwise."""
        B = len(lane.rows)
        if speculates(B, self.compiles):
            wants = [self._wanted(r) for r in lane.rows]
        else:  # no row's wish could change the step: its rows that speculate are passed over
            wants = [(1 if r.draft.speculating else 0, 1.0) for r in lane.rows]
        # (asked only where it could decide: some row drafts, in a batch)
        joining = any(d for d, _ in wants) and B > 1 and speculates(B, self.compiles) and any(
            self._prefill_time(g) is not None for g in self.groups)
        plan = decide_step(wants, B, self.costs, joining, self.compiles)
        for b, why in plan.declines:
            row = lane.rows[b]
            if row.report.state == "declined:no_proposal":
                row.report.state = f"declined:{why}"
        return plan

    def _measured(self, lane: Lane, B: int, plan: StepPlan,
                  parts: tuple[float, float, int] | None, elapsed: float) -> None:
        """A step's time into the seat's step costs and, for a request alone, into its
        speculation figures.  A step a prompt rode, or the step after a plain one that
        did (a plain step's time is its forerunner's forward), is not the rows' own cost:
        speculation and pacing never read it; what the step took beyond the rows' own is
        the ride's.  A plain step's time is believed only after a plain step of the same
        rows with no prefill forward between (`Lane.last`): it is then its forerunner's
        forward; after a verify step, a prefill or a change of rows it waited on something
        else (`seatd.batch_policy.StepCosts.settled`).  `B`: the rows the step began with."""
        own = self._aboard is None and lane.rode is None
        steady = plan.width > 1 or lane.last == (B, 1)
        lane.last = (B, plan.width)
        base = self.costs.time(B, plan.width)
        if lane.rode is not None:  # a plain step's time is its forerunner's forward
            if plan.width == 1 and base is not None:
                lane.rode.added = max(0.0, elapsed - base)
                self._ride_measured(lane.rode)
            lane.rode = None
        if self._aboard is not None:
            if plan.width == 1:
                lane.rode = self._aboard
            elif base is not None:  # a verify step waits for its own forward
                self._aboard.added = max(0.0, elapsed - base)
        # Counted either way: a probe of the other kind of step is due by steps taken.
        self.costs.observe(B, plan.width, elapsed if own and steady else None)
        if own:
            lane.step_s = elapsed if lane.step_s is None else 0.8 * lane.step_s + 0.2 * elapsed
        if B == 1 and lane.rows and own:  # a request alone: its round times are its seat's
            self._alone_measured(lane.rows[0], plan, parts, elapsed, steady)

    def _alone_measured(self, row: Row, plan: StepPlan, parts: tuple[float, float, int] | None,
                        elapsed: float, steady: bool) -> None:
        """A request alone's step into its seat's cost model and depth figures, and into
        its own times (`seatd.adaptive.OwnTimes`, which all its policies share): a
        round's time over its figure in the policy it drafted by, or a plain token's
        (timed as its forward: `steady`), with whose it was (the model drafter's, the
        lookup's, a plain token's)."""
        spec = row.work.spec
        if spec is None:
            return
        drafted = plan.depths[0] > 0
        by, depth, whose = None, 0, PLAIN
        if drafted and row.draft.drafted:  # a round: over its figure where it drafted by
            by, depth = self._figures(row, spec)[1], row.draft.drafted
            whose = LOOKUP if self._by_class(row, spec) else MODEL
        elif not drafted and steady and row.draft.speculating:
            by = spec.policy  # a plain token: every policy holds the same figure of it
        ratio = by.ratio(depth, elapsed) if by is not None else None
        if by is not None and ratio is not None:
            by.own.observe(whose, ratio)  # one store, the request's policies' all
        costs = spec.costs
        if costs is not None and parts is not None and parts[2] > 1:
            by_lookup = row.draft.by_lookup or getattr(spec.drafter, "name", "") == "lookup"
            costs.observe_round(parts[2] - 1, parts[0], parts[1], elapsed, by_lookup)
        elif costs is not None and not drafted and row.draft.speculating:
            costs.observe_plain(elapsed)
        if row.draft.speculating or row.report.state == "declined:not_profitable":
            stats = self._figures(row, spec)[0] if drafted else spec.stats
            if stats is not None and not (drafted and not row.draft.drafted):
                # a verify step that drafted nothing is no round of any depth
                observe(stats, row.draft.drafted if drafted else 0,
                        row.draft.last_kept if drafted else 0, elapsed)
                if drafted and spec.lookup_rounds is not None and self._by_class(row, spec):
                    # a lookup round: its time for every class (`lookup_policy`)
                    observe(spec.lookup_rounds, row.draft.drafted, row.draft.last_kept,
                            elapsed)

    def _wanted(self, row: Row) -> tuple[int, float]:
        """(depth, expected tokens) of this row's next round as its own policy sees it;
        depth 0: a plain token.  A parked row takes a burst of plain tokens
        (`seatd.adaptive.park_tokens`), then a probe round, as a request alone does
        (`seatd.decode`).  A row with a lookup
        drafter beside its model drafter drafts by lookup in a round where that is
        expected to pay more (`seatd.drafter_choice`), parked or not; `row.draft.by_lookup`
        says which drafted.  A lookup drafting alone (its seat's model drafter parked)
        takes no bursts: each step, the depth its match's class pays best, or a plain
        token (`_lookup_alone`)."""
        row.draft.by_lookup = False
        spec = row.work.spec
        if not row.draft.speculating or spec is None or spec.drafter is None:
            return 0, 1.0
        room = min(row.answer.budget - row.issued,
                   self.context_length - len(row.work.prompt) - (row.issued - row.start)) - 1
        if not row.draft.drafter_in:  # its drafter is still taking the prompt
            if self._drafter_due(row):
                self._drafter_prefill(row, self._catch_up_tokens())
            return self._lookup_only(row, room) if row.draft.speculating else (0, 1.0)
        if isinstance(spec.drafter, LookupDrafter) and spec.lookup_policies is not None:
            return self._lookup_alone(row, room)
        policy = spec.policy
        if policy is None:
            want = spec.depth
        elif row.draft.park_left > 0:
            row.draft.park_left -= 1
            return self._lookup_only(row, room)
        else:
            lowest = 1 if row.draft.probe else 0
            row.draft.probe = False
            choice = self._by_lookup(row, policy, lowest, room)
            # The model's best depth, as the choice found it where it made one.
            want = (choice.depth if choice is not None
                    else min(spec.depth, policy.best(lowest=lowest)))
            if not lowest and (row.draft.by_lookup or want > 0):  # drafting by its own choice
                row.draft.parks = 0
            if choice is not None and row.draft.by_lookup:
                return choice.depth, choice.expected
            if want == 0:
                row.draft.park_left = park_tokens(row.draft.parks, policy.seconds) - 1
                row.draft.probe = True
                row.draft.parks += 1
                return 0, 1.0
        depth = max(0, min(want, room))
        if isinstance(spec.drafter, LookupDrafter) and depth:
            # A lookup drafts no further than its match: no match, a plain step (a verify
            # of nothing would cost a step without the plain step's overlap).
            depth = len(spec.drafter.find(depth))
        expected = (policy.expected(depth) if policy is not None
                    else spec.stats.expected_tokens(depth))
        return depth, expected

    def _lookup_only(self, row: Row, room: int) -> tuple[int, float]:
        """A lookup round where it beats a plain token (the model drafter cannot draft
        now), else a plain token."""
        choice = self._by_lookup(row, None, 0, room)
        return (choice.depth, choice.expected) if choice is not None and row.draft.by_lookup \
            else (0, 1.0)

    def _lookup_alone(self, row: Row, room: int) -> tuple[int, float]:
        """A lookup drafting alone (its seat's model drafter parked): the depth that pays
        best for its match's class, within the match; no match, or a class where no
        depth beats a plain token: a plain token.  As beside a model drafter
        (`_by_lookup`), a class the seat has no settled figures of drafts only after
        the request's own text has judged a match of it: a first match is judged as the
        answer goes past it, and so is every match passed over."""
        spec = row.work.spec
        assert spec is not None and isinstance(spec.drafter, LookupDrafter)
        lookup, policies = spec.drafter, spec.lookup_policies or {}
        if room < 1 or not policies:
            return 0, 1.0
        self._judge_shadow(row, lookup, policies, spec.lookup_stats or {}, spec.lookup_trusted)
        follow = lookup.find(min(room, max(p.max_depth for p in policies.values())))
        policy = policies.get(lookup.key)
        if not follow or policy is None:
            return 0, 1.0
        k = policy.best(0, len(follow)) \
            if trusts(lookup.key, policies, spec.lookup_trusted) else 0
        if k == 0:
            if row.draft.shadow is None:
                row.draft.shadow = (lookup.key, len(lookup.context), follow)
            return 0, 1.0
        row.draft.shadow = None
        return k, policy.expected(k)

    def _by_lookup(self, row: Row, model: RoundPolicy | None, lowest: int,
                   room: int) -> Choice | None:
        """The round's choice between the model (`model`; None: plain only) and the
        lookup, `row.draft.by_lookup` set where it falls on the lookup; None where the lookup
        has nothing to offer (no drafter, no match, its first match judged only).

        A match the choice passes over is still judged: once the answer has gone past
        it, the tokens it would have kept count for the lookup's acceptance (a draft
        decides only how many tokens a verify keeps, and the answer says how many of
        these it would have), so a lookup that missed early is taken again where the
        text turns into a copy."""
        spec = row.work.spec
        if spec is None or spec.lookup is None or not spec.lookup_policies or room < 1 \
                or not row.draft.speculating:
            return None
        lookup = spec.lookup
        try:
            self._judge_shadow(row, lookup, spec.lookup_policies, spec.lookup_stats or {},
                               spec.lookup_trusted)
            deepest = max(p.max_depth for p in spec.lookup_policies.values())
            follow = lookup.find(min(room, deepest))
            policy = spec.lookup_policies.get(lookup.key)
            if not follow or policy is None:
                return None
            # Unless the seat had figures of this match class (or a shorter one) when the
            # request began, the request's own text judges its lookup first: its first
            # match is only judged (see above), and the lookup drafts after that, by what
            # it showed (`seatd.drafter_choice.trusts`).
            choice = (choose(model, spec.depth, policy, len(follow), model_lowest=lowest)
                      if trusts(lookup.key, spec.lookup_policies, spec.lookup_trusted)
                      else None)
        except Exception as exc:  # the lookup's fault: this row drafts by its model alone
            log.warning("drafter_failed", error=repr(exc), request_id=row.rid, drafter="lookup")
            spec.lookup = None
            return None
        # The context may lack the token the last plain step made (still unread): the
        # decision is a token behind; the round drafts from the context the verify
        # sees, and its figures count what it drafted (`_verify_step`).
        if choice is None or choice.source != "lookup":
            if row.draft.shadow is None:
                row.draft.shadow = (lookup.key, len(lookup.context), follow)
            return choice
        row.draft.shadow = None
        row.draft.by_lookup = True
        return choice

    @staticmethod
    def _judge_shadow(row: Row, lookup: LookupDrafter, policies: dict[int, RoundPolicy],
                      stats: dict[int, DepthStats], trusted: frozenset[int]) -> None:
        """Count a passed-over lookup match once the answer shows how much of it held:
        all of it, or, where the request does not trust its class yet, its first
        JUDGE_TOKENS tokens (a copy then drafts from the next step on, not only after
        the answer went past the whole match; `seatd.drafter_choice.trusts`)."""
        if row.draft.shadow is None:
            return
        key, at, follow = row.draft.shadow
        actual = lookup.context[at : at + len(follow)]
        kept = 0
        while kept < len(actual) and actual[kept] == follow[kept]:
            kept += 1
        enough = len(follow) if trusts(key, policies, trusted) \
            else min(len(follow), JUDGE_TOKENS)
        if kept == len(actual) and len(actual) < enough:
            return  # all it has seen held: wait for the rest
        row.draft.shadow = None
        # All it saw held: a round of that depth that kept everything, nothing missed.
        depth = len(follow) if kept < len(actual) else len(actual)
        if key in policies:
            policies[key].observe(depth, kept)
        if key in stats:
            observe(stats[key], depth, kept, None)

    def _sample(self, logits: mx.array, rows: list[Row],
                masks: dict[int, mx.array] | None = None) -> mx.array:
        """One token per row of logits (B, V), each by its row's own rule and position,
        from its shaped logits (`masks`: the grammar rows' masks now, by row)."""
        if any(r.shaper is not None for r in rows):
            masks = masks or {}
            logits = mx.concatenate([
                r.shaper.apply(logits[b : b + 1], r.shaper.counts, masks.get(b))
                if r.shaper is not None and not r.answer.done
                else logits[b : b + 1].astype(mx.float32) for b, r in enumerate(rows)])
        greedy = mx.argmax(logits, axis=-1)
        if all(r.params.temperature == 0 for r in rows):
            return greedy
        keyed = _keyed_noise(logits, rows)
        if all(r.params.temperature == 0 or _tempered(r) for r in rows):
            return self._sample_tempered(logits, rows, keyed, self._temperatures(rows))
        parts = []
        for b, r in enumerate(rows):
            if r.params.temperature == 0:
                parts.append(greedy[b : b + 1])
            elif b in keyed.at:  # `Keyed.token`, its noise drawn with the other seeded rows'
                scores = filter_logits(logits[b : b + 1], r.params) + keyed.of(b)
                parts.append(mx.argmax(scores, axis=-1))
            else:
                parts.append(r.draws.token(logits[b : b + 1], r.params, r.issued))
        return mx.concatenate(parts)

    @staticmethod
    def _sample_tempered(logits: mx.array, rows: list[Row], keyed: SeededNoise | None = None,
                         temperatures: tuple[mx.array, mx.array] | None = None
                         ) -> mx.array:
        """One token per row where every sampling row draws from its logits over its
        temperature alone (`_tempered`): one division and one argmax for the batch,
        where each row's own draw launches its own on a GPU.  On an H100 (demo model,
        16 rows, 5 interleaved bursts in one process), a decode step took 9.84 ms with
        unseeded rows drawing row by row, 4.98 ms drawing together, 4.64 ms at
        temperature 0, and 7.46 ms seeded with each row's noise drawn by its own
        `mx.random.gumbel`; seeded rows' noise is now one draw for them all
        (`_keyed_noise`).  A seeded row draws by the keyed rule: its scores are its
        logits over its temperature plus its position's noise, the same operations on
        the same values as its own draw (`seatd.sampling.Keyed.token`), so each token is
        the one its row's own draw makes.  The unseeded rows' noise is one block of
        Gumbel draws for all of them, keyed by the first one's chain
        (`seatd.sampling.Chained`): argmax of scores plus Gumbel noise is a draw from the
        softmax of the scores, as
        `mx.random.categorical` makes it, each row's independent of the others'.  A
        greedy row's scores are its logits.  `keyed`: the seeded rows' noise (None: drawn
        here).  `temperatures`: the rows' temperatures and which of them sample, on the
        device (`Engine._temperatures`: made once for each set of them, not every step;
        None: made here)."""
        keyed = keyed if keyed is not None else _keyed_noise(logits, rows)
        width = logits.shape[-1]
        sampling = [r for r in rows if r.params.temperature > 0]
        chains = [r.draws for r in sampling if isinstance(r.draws, Chained)]
        if chains and len(chains) == len(sampling):  # no sampling row has noise of its own
            noise = mx.random.gumbel(shape=(len(rows), width), key=chains[0].next_key())
        elif len(keyed.at) == len(rows):  # every row seeded: their noise as it was drawn
            assert keyed.noise is not None
            noise = keyed.noise
        else:
            block = (mx.random.gumbel(shape=(len(chains), width), key=chains[0].next_key())
                     if chains else None)
            zero = mx.zeros((width,), dtype=mx.float32)
            parts, j = [], 0
            for b, r in enumerate(rows):
                if r.params.temperature == 0:
                    parts.append(zero)
                elif b in keyed.at:
                    parts.append(keyed.of(b))
                else:
                    assert block is not None
                    parts.append(block[j])
                    j += 1
            noise = mx.stack(parts)
        temps, sampled = temperatures if temperatures is not None else _temperature_arrays(
            tuple(r.params.temperature for r in rows))
        scores = logits.astype(mx.float32)
        return mx.argmax(mx.where(sampled, scores / temps + noise, scores), axis=-1)

    def _temperatures(self, rows: list[Row]) -> tuple[mx.array, mx.array]:
        """The rows' temperatures (B, 1) (1 for a greedy row) and whether each samples,
        on the device: made from the host once for each set of temperatures in order, and
        kept for the next steps of the same rows (a decode step on CUDA is host-bound, and
        arrays made from host data every step are a part of it that is not the model's:
        `seatd.rows_cache.Layout`)."""
        key = tuple(r.params.temperature for r in rows)
        got = self._temps.get(key)
        if got is None:
            if len(self._temps) >= TEMPERATURE_SETS:
                self._temps.clear()
            got = self._temps[key] = _temperature_arrays(key)
        return got

    def _plain_step(self, lane: Lane) -> None:
        """One token a row.  Its time by stage (`seatd.counters.STAGES`): building the
        step's graph (the model's call, the draws), MLX dispatching it, the host waiting
        for the last step's tokens, and taking them into the answers; on a GPU, where a
        decode step is host-bound, these say where a step goes beside the bound's."""
        began = time.perf_counter()
        rows = lane.rows
        B = len(rows)
        # A grammar's mask needs its last token: such rows' tokens are read first.
        self._read(rows, [b for b, r in enumerate(rows) if r.unread and r.grammar is not None])
        masks = self._masks(rows)
        feeds = [r.feed for r in rows]
        x, rider = self._board(lane, _gather(rows, feeds)[:, None], 1)
        lane.cache.begin([1] * B, 1, rider)
        logits = self.model(x, cache=lane.cache.layers)[:B, -1, :]
        lane.cache.end()
        new = self._sample(logits, rows, masks)
        pending = [new, *(rider.state if rider is not None else ())]
        new_lps: list[tuple[mx.array, ...] | None] = []
        for b, r in enumerate(rows):
            new_lps.append(None)
            if r.prompt_left:  # its output is a prompt token's: dropped
                continue
            if r.top is not None:
                new_lps[b] = logprob_arrays(logits[b : b + 1], new[b : b + 1], r.top)
                pending.extend(new_lps[b])  # type: ignore[arg-type]
            if r.shaper is not None:
                r.shaper.advance(new[b : b + 1])
                pending.extend(r.shaper.state)
        built = time.perf_counter()
        mx.async_eval(*pending)  # type: ignore[no-untyped-call]  # MLX ships it unannotated
        sent, waited = time.perf_counter(), self._waited
        # The next step is on its way; now the host reads this step's inputs.
        self._read(rows, [b for b, r in enumerate(rows) if r.unread], feeds)
        wait = self._waited - waited
        self._staged = {"graph": built - began, "dispatch": sent - built, "wait": wait,
                        "take": time.perf_counter() - sent - wait}
        for b, r in enumerate(rows):
            if r.prompt_left:  # the next prompt token, not an answer's
                r.feed, r.fed = mx.array([r.prompt_left.pop(0)], dtype=mx.uint32), None
                continue
            r.feed, r.feed_lp = new[b : b + 1], new_lps[b]
            r.fed = Fed(new, b, r.feed)
            r.unread = True
            r.issued += 1

    def _masks(self, rows: list[Row]) -> dict[int, mx.array]:
        """The grammar rows' masks now; a grammar that fails ends its row alone."""
        out: dict[int, mx.array] = {}
        for b, r in enumerate(rows):
            grammar = r.grammar
            if grammar is None or r.answer.done:
                continue
            try:
                out[b] = grammar.mask()
            except Exception as exc:
                log.warning("grammar_failed", error=repr(exc), request_id=r.rid)
                self._finish(r, exc)
        return out

    def _read(self, rows: list[Row], which: list[int],
              feeds: list[mx.array | None] | None = None) -> None:
        """The host takes the unread tokens of rows `which` (their `feed`s, or those
        given), with their log-probabilities."""
        if not which:
            return
        feeds = feeds if feeds is not None else [r.feed for r in rows]
        asked = time.perf_counter()
        values = _ints(_gather([rows[b] for b in which], [feeds[b] for b in which]))
        self._waited += time.perf_counter() - asked
        for b, token in zip(which, values, strict=True):
            row = rows[b]
            lps: list[TokenLogprob | None] = [None]
            if row.feed_lp is not None:
                lps = list(token_logprobs(self.tokenizer, [token], row.feed_lp))
                row.feed_lp = None
            row.unread = False
            self._take(row, [token], lps)

    def _accept(self, row: Row, token: int, lp: TokenLogprob | None) -> None:
        """One sampled token into the row's answer, its log-probability beside it (the
        answer may send it at once) and its grammar."""
        if row.answer.done:
            return
        answer = row.answer
        grammar = row.grammar
        if grammar is not None:
            try:  # checked before any of its text can reach the client
                grammar.consume([token])
            except Exception as exc:  # the grammar broke: this row ends, the batch goes on
                log.warning("grammar_failed", error=repr(exc), request_id=row.rid)
                self._finish(row, exc)
                return
        before = len(answer.ids)
        if lp is not None:
            row.lps.append(lp)
        answer.take(token)
        if lp is not None and len(answer.ids) == before:
            row.lps.pop()  # an end of sequence is no answer token
        if not answer.done or token not in answer.eos:
            self.tokens += 1
        # The structured answer is whole: it ends by the grammar, even on its last
        # allowed token (a budget that ran out on the closing token is no cut answer).
        if grammar is not None and grammar.finished and (
                not answer.done or (answer.finish == "length" and not answer.cut)):
            answer.finish, answer.done = "stop", True

    def _take(self, row: Row, tokens: list[int],
              lps: Sequence[TokenLogprob | None] | None = None) -> None:
        for i, token in enumerate(tokens):
            if row.answer.done:
                return
            self._accept(row, token, lps[i] if lps is not None else None)
            spec = row.work.spec
            if row.draft.speculating and spec is not None and spec.drafter is not None \
                    and len(tokens) == 1:
                try:
                    spec.drafter.plain(token)
                    if spec.lookup is not None:
                        spec.lookup.plain(token)
                except Exception as exc:
                    log.warning("drafter_failed", error=repr(exc), request_id=row.rid)
                    row.draft.speculating = False
                    row.report.state = "declined:drafter_error"

    def _verify_step(self, lane: Lane, depths: list[int],
                     split: float | None = None) -> tuple[float, float, int] | None:
        """One verify forward over every row's block.  `split` (the step's start): the
        proposals are evaluated before the verify, and (draft, verify) seconds returned,
        with the block's width, for the cost model (`seatd.spec_costs`)."""
        rows = lane.rows
        # Read what plain steps left in flight: drafts start from the last token.
        self._read(rows, [b for b, r in enumerate(rows) if r.unread])
        if split is not None:  # the wait for a plain step in flight is not drafting
            split = time.perf_counter()
        drafts = self._propose(lane, depths)
        drafted_at = None
        if split is not None:
            mx.eval([d.tokens for d in drafts if d is not None])
            drafted_at = time.perf_counter()
        limits, masks = self._cut(rows, drafts)
        widths = [1 + lim for lim in limits]
        n = max(widths)
        pad = mx.zeros((n,), dtype=mx.uint32)
        block = mx.stack([
            mx.concatenate([r.feed, d.tokens[:lim], pad[: n - w]]) if lim  # type: ignore[list-item]
            else mx.concatenate([r.feed, pad[: n - 1]])  # type: ignore[list-item]
            for r, d, lim, w in zip(rows, drafts, limits, widths, strict=True)])
        block, rider = self._board(lane, block, n)
        lane.cache.begin(widths, n, rider)
        if n > 1 and lane.cache.recurrent_layers:
            with recurrent.recording():
                logits = self.model(block, cache=lane.cache.layers)  # (B, n, V)
        else:
            logits = self.model(block, cache=lane.cache.layers)[: len(rows)]
        lane.cache.end()
        verdicts = self._judge(rows, drafts, limits, masks, logits)
        flat = [a for v in verdicts for a in v]
        mx.eval(flat, [d.tokens for d in drafts if d is not None])
        parts = None
        if split is not None and drafted_at is not None:
            parts = (drafted_at - split, time.perf_counter() - drafted_at, n)
        keeps = []
        outs: list[list[int]] = []
        for (n_arr, t_arr), d in zip(verdicts, drafts, strict=True):
            kept, token = _ints(n_arr)[0], _ints(t_arr)[0]
            tokens_host = _ints(d.tokens) if d is not None else []
            keeps.append(kept + 1)
            outs.append([*tokens_host[:kept], token])
        lane.cache.roll_back(keeps, n)
        if lane.cache.holes() > SLACK:
            lane.cache.compact()
        token_lps = self._block_logprobs(logits, rows, outs)
        self._settle(lane, rows, drafts, outs, keeps, token_lps)
        return parts

    def _propose(self, lane: Lane, depths: list[int]) -> list[Any]:
        """Each row's draft for this verify (None: it drafts nothing this step): the
        rows drafting together in one forward per position, the others alone."""
        rows = lane.rows
        together = self._propose_together(lane, depths)
        drafts: list[Any] = []
        for b, r in enumerate(rows):
            k = depths[b] if not r.answer.done else 0
            draft = together.get(r.rid)
            spec = r.work.spec
            if draft is None and k > 0 and spec is not None and spec.drafter is not None \
                    and r.draft.speculating \
                    and (r.draft.by_lookup or lane.drafter is None or r.rid not in lane.drafter):
                drafter = spec.lookup if r.draft.by_lookup and spec.lookup is not None \
                    else spec.drafter
                try:
                    if r.shaper is not None:
                        draft = drafter.propose(k, r.params, r.draws, r.issued,
                                                shaper=r.shaper)
                    else:
                        draft = drafter.propose(k, r.params, r.draws, r.issued)
                except Exception as exc:  # a drafter's fault is a decline, never a failure
                    log.warning("drafter_failed", error=repr(exc), request_id=r.rid)
                    r.draft.speculating = False
                    r.report.state = "declined:drafter_error"
                    draft = None
            draft = draft if draft is not None and draft.k > 0 else None
            drafts.append(draft)
            r.draft.drafted = draft.k if draft is not None else 0
            lookup = ((spec.lookup if r.draft.by_lookup else spec.drafter) if spec is not None
                      else None)
            if isinstance(lookup, LookupDrafter):
                r.draft.lookup_key = lookup.key  # of the match it drafted from
        return drafts

    def _cut(self, rows: list[Row], drafts: list[Any]
             ) -> tuple[list[int], list[mx.array | None]]:
        """How much of each row's draft the verify takes, and its grammar's masks."""
        # A grammar cuts a draft before its first forbidden token (never accepted); the
        # masks of the positions verified come with the cut.
        limits: list[int] = []
        masks: list[mx.array | None] = []
        for r, d in zip(rows, drafts, strict=True):
            grammar = r.grammar
            if grammar is None or r.answer.done:
                limits.append(d.k if d is not None else 0)
                masks.append(None)
                continue
            try:
                if d is None:
                    along, allowed = grammar.mask()[None], 0
                else:
                    along, allowed = grammar.masks_along(_ints(d.tokens))
            except Exception as exc:  # the grammar broke: this row ends, the batch goes on
                log.warning("grammar_failed", error=repr(exc), request_id=r.rid)
                self._finish(r, exc)
                along, allowed = None, 0
            limits.append(allowed)
            masks.append(along[: allowed + 1] if along is not None else None)
        return limits, masks

    def _judge(self, rows: list[Row], drafts: list[Any], limits: list[int],
               masks: list[mx.array | None], logits: mx.array
               ) -> list[tuple[mx.array, mx.array]]:
        """Each row's verdict on the device: (drafts kept, the next token), by its
        rule: greedy, keyed (seeded), or rejection sampling."""
        verdicts: list[tuple[mx.array, mx.array]] = []
        for b, (r, d, lim, mask) in enumerate(zip(rows, drafts, limits, masks, strict=True)):
            shaped = r.shaper is not None and not r.answer.done
            if d is None or lim == 0:
                first = logits[b : b + 1, 0, :]
                if shaped:
                    assert r.shaper is not None
                    first = r.shaper.apply(first, r.shaper.counts,
                                           mask[0] if mask is not None else None)
                pick = (r.draws.token(first, r.params, r.issued) if r.params.temperature > 0
                        else mx.argmax(first, axis=-1))
                verdicts.append((mx.array([0]), pick))
                continue
            tokens = d.tokens[:lim]
            own = logits[b : b + 1, : lim + 1, :]
            if shaped:
                assert r.shaper is not None
                own = r.shaper.shape_block(own, tokens, mask)
            verdicts.append(judge(own, tokens, d.probs[:lim] if d.probs is not None else None,
                                  r.params, r.draws, r.issued))
        return verdicts

    def _settle(self, lane: Lane, rows: list[Row], drafts: list[Any], outs: list[list[int]],
                keeps: list[int], token_lps: list[list[TokenLogprob | None]]) -> None:
        """The verdicts into the rows: their answers, feeds, counts and drafters."""
        for r, d, out, keep, lps in zip(rows, drafts, outs, keeps, token_lps, strict=True):
            r.issued += len(out)
            r.feed = mx.array([out[-1]], dtype=mx.uint32)
            r.unread = False
            if r.shaper is not None:
                r.shaper.advance(r.feed if len(out) == 1 else mx.array(out, dtype=mx.uint32))
            spec = r.work.spec
            if d is not None and spec is not None:
                kept = keep - 1
                self._account(r, spec, d.k, kept)
                assert spec.drafter is not None
                try:
                    tokens = out[:-1] + [0] * (d.k - kept)
                    if r.draft.by_lookup and spec.lookup is not None:
                        spec.lookup.settle(kept, d.k, out[-1], tokens)
                        for token in out:  # the model drafter takes them with its next draft
                            spec.drafter.plain(token)
                    elif lane.drafter is not None and r.rid in lane.drafter:
                        lane.drafter.settle(r.rid, kept, d.k, out[-1], tokens)
                    else:
                        spec.drafter.settle(kept, d.k, out[-1], tokens)
                    if not r.draft.by_lookup and spec.lookup is not None:
                        spec.lookup.settle(kept, d.k, out[-1], tokens)
                except Exception as exc:
                    log.warning("drafter_failed", error=repr(exc), request_id=r.rid)
                    r.draft.speculating = False
                    r.report.state = "declined:drafter_error"
                for token, lp in zip(out, lps, strict=True):
                    if r.answer.done:
                        break
                    self._accept(r, token, lp)
            else:
                self._take(r, out, lps)

    def _block_logprobs(self, logits: mx.array, rows: list[Row], outs: list[list[int]]
                        ) -> list[list[TokenLogprob | None]]:
        """Each row's log-probabilities of the tokens a verify step kept, from the rows
        of the block's raw logits at their positions."""
        arrays = {b: logprob_arrays(logits[b, : len(out), :], mx.array(out, dtype=mx.uint32),
                                    r.top)
                  for b, (r, out) in enumerate(zip(rows, outs, strict=True))
                  if r.top is not None}
        if not arrays:
            return [[None] * len(out) for out in outs]
        mx.eval(*(a for v in arrays.values() for a in v))
        return [list(token_logprobs(self.tokenizer, out, arrays[b])) if b in arrays
                else [None] * len(out) for b, out in enumerate(outs)]

    def _propose_together(self, lane: Lane, depths: list[int]) -> dict[str, Any]:
        """The drafts of the rows that draft together, in one forward per position."""
        if lane.drafter is None:
            return {}
        asks = {r.rid: Ask(k, r.params, r.draws, r.issued, r.shaper)
                for r, k in zip(lane.rows, depths, strict=True)
                if k > 0 and not r.answer.done and not r.draft.by_lookup and r.rid in lane.drafter}
        if not asks:
            return {}
        try:
            return dict(lane.drafter.propose(asks))
        except Exception as exc:  # a drafter's fault is a decline, never a failure
            log.warning("drafter_failed", error=repr(exc), rows=len(asks),
                        request_ids=list(asks))
            for r in lane.rows:
                if r.rid in lane.drafter:
                    r.draft.speculating = False
                    r.report.state = "declined:drafter_error"
            lane.drafter, lane.drafter_off = None, True
            return {}

    def _account(self, row: Row, spec: Speculation, drafted: int, kept: int) -> None:
        report = row.report
        row.draft.last_kept = kept
        stats, policy = self._figures(row, spec)
        if len(self._batch_of(row)) > 1 and stats is not None:  # alone, the step's time
            observe(stats, drafted, kept, None)  # goes in with it
        if policy is not None:
            policy.observe(drafted, kept)
        drafter = spec.lookup if row.draft.by_lookup else spec.drafter
        report.verified(drafted, kept, getattr(drafter, "name", "model"))

    @staticmethod
    def _figures(row: Row, spec: Speculation) -> tuple[DepthStats | None, RoundPolicy | None]:
        """The seat's figures and the request's policy that this row's last round counts
        for: a lookup round's, by the class of the match it drafted from."""
        if Engine._by_class(row, spec) and spec.lookup_stats is not None \
                and spec.lookup_policies is not None:
            key = row.draft.lookup_key
            return spec.lookup_stats.get(key), spec.lookup_policies.get(key)
        return spec.stats, spec.policy

    @staticmethod
    def _by_class(row: Row, spec: Speculation) -> bool:
        """Whether the row's last round counts by its lookup match's class: drafted by
        the lookup beside a model drafter, or by a lookup drafting alone."""
        return row.draft.by_lookup or (isinstance(spec.drafter, LookupDrafter)
                                       and spec.lookup_policies is not None)

    def _batch_of(self, row: Row) -> list[Row]:
        lane = self.lanes.get(row.lane)
        return lane.rows if lane is not None else []

    # -- leaving ----------------------------------------------------------------

    def _cancels(self) -> None:
        for group in list(self.groups):
            for row in [r for r in group.rows if r.work.cancel.is_set()]:
                self._drop_joining(group, row, RowCancelled())
            if not group.rows:
                self.groups.remove(group)
        for lane in self.lanes.values():
            if any(r.work.cancel.is_set() or r.work.complete.is_set() for r in lane.rows):
                for r in lane.rows:
                    if r.work.cancel.is_set():
                        self._finish(r, RowCancelled())
                    elif r.work.complete.is_set() and not r.answer.done:
                        r.answer.finish, r.answer.done = "stop", True  # leaves below
                self._leave(lane)

    def _leave(self, lane: Lane) -> None:
        keep: list[int] = []
        gone: list[int] = []
        for b, r in enumerate(lane.rows):
            if r.answer.done and not r.answer.closed:
                self._finish(r, None)
            (gone if r.answer.closed else keep).append(b)
        if gone:
            lane.rows = [lane.rows[b] for b in keep]
            lane.cache.drop(keep)
        self._drafters_keep(lane)
        if lane.drafter is not None:
            lane.drafter.tidy()

    def _finish(self, row: Row, error: BaseException | None) -> None:
        """The row ends: its answer, or its error, goes back to the worker."""
        work = row.work
        row.answer.done = True
        result = None
        if error is None:
            row.answer.close()
            result = DecodeResult(row.answer.text, row.answer.finish, len(work.prompt),
                                  row.answer.produced, row.report,
                                  work.resume.start if work.resume is not None else 0,
                                  row.answer.ids, beside=row.beside,
                                  stop_sequence=row.answer.stop_sequence)
        else:
            row.answer.closed = True
        with _naming(work):
            if work.finish is not None:  # the prompt cache keeps its copy while the row's
                work.finish(error is None or isinstance(error, RowCancelled))  # room is held
            self.budget.release(work.reserve)
        self.outbox.put(Ended(row.rid, result, error, len(work.prompt), work.first_token_at))



@dataclass(frozen=True)
class SeededNoise:
    """The seeded sampling rows' noise of a step: row b's is `noise[at[b]]`."""

    at: dict[int, int]
    noise: mx.array | None

    def of(self, b: int) -> mx.array:
        assert self.noise is not None
        return self.noise[self.at[b]]


def _keyed_noise(logits: mx.array, rows: Sequence[Row]) -> SeededNoise:
    """The noise of the rows that sample by the keyed rule, each at its position, drawn
    together (`seatd.sampling.keyed_noise`): one random call where each row's own draw
    made one a row, each row's values bit for bit its own draw's."""
    seeded = {b: r.draws for b, r in enumerate(rows)
              if r.params.temperature > 0 and isinstance(r.draws, Keyed)}
    if not seeded:
        return SeededNoise({}, None)
    noise = keyed_noise(list(seeded.values()), [rows[b].issued for b in seeded],
                        logits.shape[-1])
    return SeededNoise({b: j for j, b in enumerate(seeded)}, noise)


def _temperature_arrays(temperatures: tuple[float, ...]) -> tuple[mx.array, mx.array]:
    """(B, 1) temperatures (1 for a greedy row) and (B, 1) whether each row samples."""
    return (mx.array([[t or 1.0] for t in temperatures], dtype=mx.float32),
            mx.array([[t > 0] for t in temperatures]))


def _tempered(row: Row) -> bool:
    """Whether the row samples from its logits over its temperature alone (no top-k,
    top-p or min-p filter), seeded or not: its draw is elementwise, row by row."""
    p = row.params
    return p.temperature > 0 and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0


def _filled(tokens: Sequence[int], n: int) -> list[int]:
    """A row's piece of a prefill step, `n` tokens: its own, then its last repeated."""
    return [*tokens, *[tokens[-1]] * (n - len(tokens))] if len(tokens) < n else list(tokens)


def _gather(rows: Sequence[Row], feeds: Sequence[mx.array | None]) -> mx.array:
    """The rows' feeds as one (B,) array: the tokens of the plain step that fed them all,
    in its order, where they are that (no copy: on a GPU a concatenation launches a copy
    per row, each step), else their concatenation."""
    first = rows[0].fed if rows else None
    if first is not None and first.whole.shape[0] == len(rows) and all(
            r.fed is not None and r.fed.whole is first.whole and r.fed.b == b
            and r.fed.feed is f for b, (r, f) in enumerate(zip(rows, feeds, strict=True))):
        return first.whole
    return mx.concatenate(list(feeds))  # type: ignore[arg-type]


def _ints(a: mx.array) -> list[int]:
    """A (n,) integer array's values on the host."""
    values: Any = a.tolist()
    return [int(v) for v in values]


def _nbytes(cache: list[Any] | None) -> int:
    total = 0
    for c in cache or []:
        try:
            total += int(c.nbytes)
        except Exception:  # a layer that cannot say (empty, or not a cache at all)
            continue
    return total
